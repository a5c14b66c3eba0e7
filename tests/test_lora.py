"""Multi-adapter LoRA layers (`inflight.models.lora`, `lora_adapter`) against the naive reference: per row,
y = W x + b + (32 / r) * B A x with that row's own adapter, written out explicitly, for values and gradients.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from inflight.models import load_model
from inflight.models.lora import LoraPlan, LoraRouter, MultiLoraLinear, attach_multi_lora
from inflight.models.lora_adapter import LoraAdapter, peft_key, select_targets

IN, OUT = 6, 5


def _adapter(rank: int, seed: int, module: str = "layer", random_b: bool = True) -> LoraAdapter:
    adapter = LoraAdapter.create({module: (IN, OUT)}, rank=rank, seed=seed)
    if random_b:  # a fresh adapter has B = 0; give it a nonzero delta to test
        with torch.no_grad():
            adapter.modules[module][1].normal_(generator=torch.Generator().manual_seed(seed + 100))
    return adapter


def _explicit(base: nn.Linear, x_B_T_I: torch.Tensor, adapters: list[LoraAdapter | None], module: str):
    """Row by row: W x + b, plus s * B A x when the row's adapter trains `module`."""
    rows = []
    for x_T_I, adapter in zip(x_B_T_I, adapters, strict=True):
        y = x_T_I @ base.weight.T + base.bias
        if adapter is not None and module in adapter.modules:
            a, b = adapter.modules[module]
            y = y + adapter.scale * (x_T_I @ a.T @ b.T)
        rows.append(y)
    return torch.stack(rows)


def _layer(seed: int = 0) -> tuple[nn.Linear, LoraRouter, MultiLoraLinear]:
    torch.manual_seed(seed)
    base = nn.Linear(IN, OUT).requires_grad_(False)
    router = LoraRouter()
    return base, router, MultiLoraLinear(base, "layer", router)


@pytest.mark.parametrize("tokens", [1, 3])  # one token per row: the grouped form; more: the gathered one
@pytest.mark.parametrize(
    "row_slot",
    [
        [0, 1, 2, 3, 1, 0],  # unsorted runs of 1 row: chunks of one row, each gathering its A/B
        [0, 0, 1, 1, 2, 2, 3, 3],  # sorted equal runs: each slot is one chunk, the stacks used as they are
        [1, 1, 1, 1, 0, 0],  # runs of 4 and 2, unsorted: chunks of 2 rows (gcd), gathered and permuted
        [0, 0, 0],  # one adapter for every row: its own A/B, fused into the base layer
        [0, 0, 1, 1, 3, 3],  # sorted runs of 2 that take their A/B by gather (slot 2 has no rows)
    ],
)
# Ranks 2 and 4: A/B zero-padded to one rank, scales 16 and 8 folded into B; rank 32 twice: scale 1, as is.
@pytest.mark.parametrize("ranks", [(2, 4), (32, 32)])
def test_mixed_adapters_per_row_match_the_explicit_formula_in_value_and_gradient(tokens, row_slot, ranks):
    base, router, layer = _layer()
    a1, a2 = _adapter(ranks[0], seed=1), _adapter(ranks[1], seed=2)
    other = LoraAdapter.create({"elsewhere": (IN, OUT)}, rank=3, seed=3)  # does not train "layer"
    slots = [a1, a2, other, None]
    x = torch.randn(len(row_slot), tokens, IN, requires_grad=True)
    with router.use(LoraPlan(slots, row_slot)):
        y = layer(x)
    expected_adapters = [slots[s] for s in row_slot]
    torch.testing.assert_close(y, _explicit(base, x, expected_adapters, "layer"))

    # Gradients (adapters' A and B, and the input's): the same scalar through the batched layer and
    # through the explicit formula.
    weights = torch.randn_like(y)
    (y * weights).sum().backward()
    tensors = {"a1A": a1.modules["layer"][0], "a1B": a1.modules["layer"][1]}
    tensors |= {"a2A": a2.modules["layer"][0], "a2B": a2.modules["layer"][1], "x": x}
    batched = {name: None if t.grad is None else t.grad.clone() for name, t in tensors.items()}
    for t in tensors.values():
        t.grad = None
    (_explicit(base, x, expected_adapters, "layer") * weights).sum().backward()
    for name, t in tensors.items():
        torch.testing.assert_close(batched[name], t.grad, msg=name)
    assert float(batched["x"].abs().sum()) > 0 and float(batched["a1A"].abs().sum()) > 0
    assert other.modules["elsewhere"][0].grad is None  # untouched: it never reached this layer


@pytest.mark.parametrize(
    ("row_slot", "tokens", "fused"),
    [
        ([0, 0, 1, 1], 4, True),  # the engine's usual batch: sorted equal runs
        ([1, 1, 1], 4, True),  # one adapter
        ([0, 1, 1, 0], 4, False),  # unsorted: the rows would need a permutation
        ([0, 0, 1, 1, 3, 3], 1, False),  # decode rows that gather weights: the grouped form
    ],
)
def test_sorted_rows_run_lora_fused_into_the_base_layer(row_slot, tokens, fused):
    _, router, layer = _layer()
    slots = [_adapter(4, seed=1), _adapter(4, seed=2), None, _adapter(2, seed=3)]
    with router.use(LoraPlan(slots, row_slot)):
        y = layer(torch.randn(len(row_slot), tokens, IN))
    assert (type(y.grad_fn).__name__ == "LoraLinearFunctionBackward") == fused


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    row_slot=st.lists(st.integers(0, 4), min_size=1, max_size=7),
    tokens=st.integers(1, 4),
    sort_rows=st.booleans(),
)
def test_any_assignment_of_rows_to_adapters_matches_the_explicit_formula(ranks, row_slot, tokens, sort_rows):
    base, router, layer = _layer(seed=len(ranks))
    slots: list[LoraAdapter | None] = [_adapter(r, seed=i) for i, r in enumerate(ranks)] + [None]
    row_slot = [s % len(slots) for s in row_slot]
    if sort_rows:  # as the engine passes them (no permutation needed)
        row_slot.sort()
    x = torch.randn(len(row_slot), tokens, IN, generator=torch.Generator().manual_seed(len(row_slot)))
    with torch.no_grad(), router.use(LoraPlan(slots, row_slot)):
        y = layer(x)
    torch.testing.assert_close(y, _explicit(base, x, [slots[s] for s in row_slot], "layer"))


@pytest.mark.parametrize("tokens", [1, 3])
def test_bfloat16_base_rounds_a_row_alike_in_any_batch_and_trains_float32_adapters(tokens):
    """bfloat16 base weights with float32 adapters: the LoRA matmuls run in bfloat16 (as under autocast) and
    a row's output is bit for bit the same alone (the fused node) or among other adapters' rows in any
    order (the grouped form without autograd), so seeded sampling cannot depend on the batch; gradients
    come back to the float32 adapters, close to the float32 formula."""
    base, router, layer = _layer()
    base.to(torch.bfloat16)
    a1, a2 = _adapter(4, seed=1), _adapter(2, seed=2)
    x = torch.randn(1, tokens, IN).bfloat16()
    others = torch.randn(3, tokens, IN).bfloat16()
    with torch.no_grad():
        with router.use(LoraPlan([a1], [0])):
            alone = layer(x)
        for row_slot in ([1, 0, 2, 1], [0, 1, 1, 2]):  # unsorted, and sorted runs of unequal length
            batch = torch.cat([others[:1], x, others[1:]]) if row_slot[1] == 0 else torch.cat([x, others])
            row = row_slot.index(0)
            with router.use(LoraPlan([a1, a2, None], row_slot)):
                assert torch.equal(layer(batch)[row], alone[0])

    x.requires_grad_(True)
    with router.use(LoraPlan([a1, a2], [0, 1])):
        y = layer(torch.cat([x, others[:1]]))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    a, b = a1.modules["layer"]
    grad_a, grad_b = a.grad, b.grad
    assert grad_a is not None and grad_b is not None and grad_a.dtype == grad_b.dtype == torch.float32
    a.grad = b.grad = None
    x32 = x.detach().float()
    (a1.scale * (x32 @ a.T @ b.T)).sum().backward()
    torch.testing.assert_close(grad_a, a.grad, rtol=0.02, atol=0.02 * float(a.grad.abs().max()))
    torch.testing.assert_close(grad_b, b.grad, rtol=0.02, atol=0.02 * float(b.grad.abs().max()))


def test_no_plan_or_no_adapter_is_exactly_the_base_layer():
    base, router, layer = _layer()
    x = torch.randn(3, 2, IN)
    assert torch.equal(layer(x), base(x))
    with router.use(LoraPlan([None], [0, 0, 0])):
        assert torch.equal(layer(x), base(x))


def test_plan_rejects_inputs_that_do_not_match_its_rows():
    _, router, layer = _layer()
    with router.use(LoraPlan([_adapter(2, seed=0)], [0, 0])), pytest.raises(ValueError, match="rows=2"):
        layer(torch.randn(3, 1, IN))
    with pytest.raises(ValueError, match="row_slot"):
        LoraPlan([None], [0, 1])


def test_select_rows_keeps_each_rows_adapter():
    base, router, layer = _layer()
    slots: list[LoraAdapter | None] = [_adapter(2, seed=0), _adapter(3, seed=1)]
    plan = LoraPlan(slots, [0, 1, 1, 0])
    kept = plan.select_rows(torch.tensor([3, 1]))
    x = torch.randn(2, 1, IN)
    with torch.no_grad(), router.use(kept):
        torch.testing.assert_close(layer(x), _explicit(base, x, [slots[0], slots[1]], "layer"))


def test_new_adapter_init_scale_and_seed():
    shapes = {"a.q_proj": (8, 4), "a.down_proj": (16, 8)}
    adapter = LoraAdapter.create(shapes, rank=16, seed=5)
    assert adapter.scale == 32 / 16
    for name, (a, b) in adapter.modules.items():
        fan_in, fan_out = shapes[name]
        assert a.shape == (16, fan_in) and b.shape == (fan_out, 16)
        assert float(a.detach().abs().max()) <= 1 / math.sqrt(
            fan_in
        )  # PEFT's kaiming_uniform(a=sqrt(5)) bound
        assert torch.count_nonzero(b) == 0 and a.requires_grad and b.requires_grad
    same = LoraAdapter.create(shapes, rank=16, seed=5)
    other = LoraAdapter.create(shapes, rank=16, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(adapter.parameters(), same.parameters(), strict=True))
    assert not torch.equal(adapter.parameters()[0], other.parameters()[0])


def test_state_dict_round_trip_and_mismatch():
    shapes = {"model.layers.0.self_attn.q_proj": (8, 8)}
    adapter = _adapter_with(shapes, rank=4, seed=1)
    tensors = adapter.state_dict()
    assert set(tensors) == {
        peft_key("model.layers.0.self_attn.q_proj", "A"),
        peft_key("model.layers.0.self_attn.q_proj", "B"),
    }
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors  # PEFT's naming
    copy = LoraAdapter.create(shapes, rank=4, seed=2)
    copy.load_state_dict(tensors)
    assert all(torch.equal(x, y) for x, y in zip(adapter.parameters(), copy.parameters(), strict=True))
    frozen = adapter.frozen_copy()
    with torch.no_grad():
        adapter.parameters()[0].add_(1.0)
    assert not frozen.parameters()[0].requires_grad
    assert torch.equal(frozen.parameters()[0], tensors[peft_key("model.layers.0.self_attn.q_proj", "A")])
    with pytest.raises(ValueError, match="do not match"):
        LoraAdapter.create(shapes, rank=8, seed=0).load_state_dict({"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="wrong shapes"):
        LoraAdapter.create(shapes, rank=2, seed=0).load_state_dict(tensors)


def _adapter_with(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> LoraAdapter:
    adapter = LoraAdapter.create(shapes, rank=rank, seed=seed)
    with torch.no_grad():
        for _, b in adapter.modules.values():
            b.normal_()
    return adapter


def test_select_targets_by_tinker_group():
    shapes = {
        "model.layers.0.self_attn.q_proj": (4, 4),
        "model.layers.0.self_attn.o_proj": (4, 4),
        "model.layers.0.mlp.up_proj": (4, 8),
        "lm_head": (4, 16),
    }
    assert set(select_targets(shapes, True, False, False)) == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
    }
    assert set(select_targets(shapes, False, True, True)) == {"model.layers.0.mlp.up_proj", "lm_head"}
    assert select_targets(shapes, False, False, False) == {}


def test_fresh_adapters_on_a_real_model_equal_the_base_model(tiny_model_dir: Path):
    reference = load_model(tiny_model_dir)
    model = load_model(tiny_model_dir)
    router, shapes = attach_multi_lora(model)
    assert not any(p.requires_grad for p in model.parameters())  # base frozen; only adapters train
    assert {name.rsplit(".", 1)[-1] for name in shapes} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    }
    ids = torch.randint(0, reference.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    fresh = [LoraAdapter.create(shapes, rank=r, seed=r) for r in (1, 8)]
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, expected)
        with router.use(LoraPlan(fresh, [0, 1, 0])):
            assert torch.equal(model(input_ids=ids).logits, expected)  # B = 0 adds exact zeros


def test_attach_rejects_a_model_without_known_layers():
    with pytest.raises(ValueError, match="Llama/Qwen"):
        attach_multi_lora(nn.Sequential(nn.Linear(2, 2)))
