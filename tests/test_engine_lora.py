"""The built-in engine's own side of LoRA, devices and prompt logprobs, beyond the backend contract
(tests/test_engine_contract.py). References: the explicit per-row formula x W^T + scale * (x A^T) B^T for
the masked-dense form; a Hugging Face forward with the adapter merged (W + scale * B @ A) for whole-engine
numerics; `models/device.py` for device names. The `gpu` tests need CUDA and skip without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from inflight.errors import UserError
from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.adapters import FusedAdapter, LoraStacks, parse_adapter
from inflight.types import AdapterUpdate, Completion, SampleRequest, SamplingParams
from test_engine_contract import (
    VOCAB,
    make_adapter,
    merged,
    prompts,
    ref_logits,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5000.0,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).eval()


def engine_for(model, **config) -> BuiltinEngine:
    return BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=8, max_seq_len_tokens=64, **config))


@pytest.mark.parametrize(
    "rows,chunked",
    [
        ([None, 1, 0, 0, None, 1], False),  # scattered, base rows among them: masked-dense
        ([1, 1, 0, 0], True),  # one equal run per adapter: chunked
        ([0, 0, 0], True),  # a single adapter
        ([0, 0, 1], False),  # unequal runs
    ],
)
def test_lora_forms_equal_the_per_row_formula(rows: list[int | None], chunked: bool) -> None:
    """Fused sites with parts (q/k/v-like), adapters of different ranks, one lacking a part and one lacking
    a whole site, rows without an adapter; every form (LoraBatch.add_, .add_halves_ and .delta), with A
    read transposed (ranks up to 8) and contiguous (qkv and gate/up stack the parts' ranks past 8)."""
    g = torch.Generator().manual_seed(0)
    layout = {
        "qkv": [("q", 0, 6), ("k", 6, 4), ("v", 10, 4)],
        "gate_up": [("g", 0, 6), ("u", 6, 6)],
        "down": [("d", 0, 5)],
    }
    shapes = {"q": (8, 6), "k": (8, 4), "v": (8, 4), "g": (8, 6), "u": (8, 6), "d": (8, 5)}

    def modules(rank: int, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            n: (torch.randn(rank, 8, generator=g), torch.randn(shapes[n][1], rank, generator=g))
            for n in names
        }

    specs = [(2, 0.5, modules(2, ["q", "v", "g", "d"])), (5, 1.5, modules(5, ["q", "k", "v", "g", "u"]))]
    fused = [
        FusedAdapter.build(m, scale, layout, torch.float32, torch.device("cpu")) for _, scale, m in specs
    ]
    x = torch.randn(len(rows), 8, generator=g)
    batch = LoraStacks(list(layout), torch.float32, torch.device("cpu")).batch(
        [None if r is None else fused[r] for r in rows]
    )
    assert batch is not None and batch.chunked == chunked
    for site, parts in layout.items():
        width = sum(w for _, _, w in parts)
        out = torch.zeros(len(rows), width)
        batch.add_(out, site, x)
        delta = batch.delta(site, x)
        expected = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            if r is None:
                continue
            _, scale, mods = specs[r]
            for name, start, w in parts:
                if name in mods:
                    a, b = mods[name]
                    expected[i, start : start + w] = scale * (x[i] @ a.t()) @ b.t()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
        if width % 2 == 0:  # the output as its two column halves, [2, rows, width / 2]
            halves = torch.zeros(2, len(rows), width // 2)
            batch.add_halves_(halves, site, x)
            joined = torch.cat([halves[0], halves[1]], dim=1)
            torch.testing.assert_close(joined, expected, rtol=1e-5, atol=1e-5)
    assert LoraStacks(list(layout), torch.float32, torch.device("cpu")).batch([None, None]) is None


def test_parse_adapter_names_the_module_and_the_fix(model) -> None:
    shapes = {"model.layers.0.self_attn.q_proj": (64, 64)}
    update = make_adapter(model, "x", rank=2, seed=0)
    with pytest.raises(
        ValueError, match=r"module 'model\.layers\.0\.mlp\.down_proj' is not a LoRA target.*q_proj"
    ):
        parse_adapter(update, shapes)
    for bad, match in [
        (AdapterUpdate("", 0, 2, 1.0, {}), "non-empty"),
        (AdapterUpdate("x", 0, 0, 1.0, {"t": torch.zeros(1)}), "rank"),
        (AdapterUpdate("x", 0, 2, 1.0, {"weird": torch.zeros(1)}), "PEFT"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_adapter(bad, shapes)


def test_recompute_after_an_adapter_replacement_continues_exactly_on_the_new_weights(model) -> None:
    engine = engine_for(model, kv_policy="recompute")
    a1, a2 = (
        make_adapter(model, "a", rank=4, seed=1, version=1),
        make_adapter(model, "a", rank=4, seed=2, version=2),
    )
    engine.set_adapter(a1)
    prompt = prompts([6])[0]
    request = SampleRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0), adapter="a")
    base = SampleRequest(prompts([4])[0], SamplingParams(max_tokens=8, temperature=0.0))
    engine.add_request(base)
    engine.add_request(request)
    done = {}
    for _ in range(3):
        done.update((c.request_id, c) for c in engine.step())
    engine.set_adapter(a2)
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    out = done[request.request_id]
    assert out.versions == [1] * 3 + [2] * 5
    # With the prefix recomputed, every token after the switch is what v2 gives for the whole sequence.
    logits = ref_logits(merged(model, a2), prompt + out.token_ids)[len(prompt) - 1 : -1]
    assert out.token_ids[3:] == logits.argmax(-1).tolist()[3:]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert (torch.tensor(out.logprobs[3:]) - expected[3:]).abs().max() < 1e-4
    m = engine.metrics()
    assert m.adapter_updates_received == 2 and m.adapter_updates_applied == 1 and m.adapters_registered == 1
    assert m.tokens_on_stale_kv == 0


def test_one_packed_prefill_of_unequal_prompts_and_adapters_equals_the_merged_references(model) -> None:
    """Prompts of different lengths, two adapters and the base weights admitted in one step: one packed
    prefill (the adapters' rows of unequal token runs take the masked-dense form), each prompt's first
    logprob and greedy continuation as a Hugging Face forward with its adapter merged gives them."""
    engine = engine_for(model)
    adapters = [
        make_adapter(model, name, rank=r, seed=s, version=1) for name, r, s in [("a", 4, 1), ("b", 2, 2)]
    ]
    for update in adapters:
        engine.set_adapter(update)
    lengths, names = [3, 11, 6, 9, 1], ["a", None, "b", "a", "b"]
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=4, temperature=0.0), adapter=name)
        for p, name in zip(prompts(lengths), names, strict=True)
    ]
    done = {c.request_id: c for c in engine.generate(requests)}
    assert engine.metrics().prefill_failures == 0
    for request, name in zip(requests, names, strict=True):
        reference = model if name is None else merged(model, adapters["ab".index(name)])
        out = done[request.request_id]
        logits = ref_logits(reference, request.prompt_token_ids + out.token_ids)[
            len(request.prompt_token_ids) - 1 : -1
        ]
        assert out.token_ids == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert (torch.tensor(out.logprobs) - expected).abs().max() < 1e-4


def _joining_step(
    model, mark: int | None = None
) -> tuple[BuiltinEngine, list[SampleRequest], dict[str, AdapterUpdate]]:
    """An engine (two adapters, a prefix cache) with two rows running, and newcomers waiting to join them
    at its next step: a fresh prompt (adapter b), a GRPO-like group of one prompt twice (adapter a: one
    leader, one copy), a next turn of a finished episode (base: it resumes that episode's cached K/V) and,
    with `mark`, a prompt holding that token. Returns the engine, every request and the adapters by name."""
    engine = engine_for(model, prefix_cache_rows=4)
    adapters = {
        name: make_adapter(model, name, rank=r, seed=s, version=1)
        for name, r, s in [("a", 4, 1), ("b", 2, 2)]
    }
    for update in adapters.values():
        engine.set_adapter(update)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    first_turn = SampleRequest(prompts([7], seed=3)[0], greedy)
    (done,) = engine.generate([first_turn])
    next_turn = first_turn.prompt_token_ids + done.token_ids + prompts([4], seed=4)[0]
    running = [SampleRequest(p, greedy, adapter=n) for p, n in zip(prompts([5, 9]), [None, "a"], strict=True)]
    for request in running:
        engine.add_request(request)
    engine.step()  # prefill only: both rows are running now
    group = prompts([8], seed=5)[0]
    joining = [(prompts([6], seed=6)[0], "b"), (group, "a"), (group, "a"), (next_turn, None)]
    if mark is not None:
        joining.insert(2, (prompts([3], seed=7)[0] + [mark], "b"))
    newcomers = [SampleRequest(p, greedy, adapter=n) for p, n in joining]
    for request in newcomers:
        engine.add_request(request)
    return engine, [first_turn, *running, *newcomers], adapters


def _finish(engine: BuiltinEngine) -> dict[str, Completion]:
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    return done


def _assert_greedy_as_merged(model, adapters: dict[str, AdapterUpdate], request: SampleRequest, out) -> None:
    """The completion is the greedy continuation of a Hugging Face forward with its adapter merged."""
    reference = model if request.adapter is None else merged(model, adapters[request.adapter])
    logits = ref_logits(reference, request.prompt_token_ids + out.token_ids)[
        len(request.prompt_token_ids) - 1 : -1
    ]
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert (torch.tensor(out.logprobs) - expected).abs().max() < 1e-4


def test_newcomers_join_running_rows_in_one_pass_as_the_merged_references_give(model) -> None:
    """A step with running rows and newcomers (fresh, a shared prompt, a resumed prefix; mixed adapters)
    runs one forward pass (`decode_and_prefill`), not a decode and prefills apart, and every completion is
    what a Hugging Face forward with its adapter merged gives."""
    engine, requests, adapters = _joining_step(model)
    runner = engine._runner
    calls: list[tuple[int, list[int]]] = []
    real = runner.decode_and_prefill

    def spied(tokens, positions, prompts_, cached, adapters):
        calls.append((len(tokens), list(cached)))
        return real(tokens, positions, prompts_, cached, adapters)

    runner.decode_and_prefill = spied  # type: ignore[method-assign]
    before = engine.metrics()
    done = _finish(engine)
    # The joining step, the only one with newcomers: 2 decoded rows, 3 leaders (the resumed one first, its
    # first turn's 7 + 6 tokens cached but the last, which was sampled and never fed back), 1 copy.
    assert calls == [(2, [12, 0, 0])], calls
    after = engine.metrics()
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == 12
    assert after.prompt_tokens_shared - before.prompt_tokens_shared == 8
    assert after.prefill_failures == 0
    for request in requests[1:]:
        _assert_greedy_as_merged(model, adapters, request, done[request.request_id])


def test_a_newcomer_whose_prefill_fails_in_the_one_pass_fails_alone(model) -> None:
    """The one pass raises for a hostile newcomer (as if its prompt ran the engine out of memory): the step
    runs apart, the newcomer fails with the error, and every other row goes on as the references give."""
    mark = VOCAB - 1
    engine, requests, adapters = _joining_step(model, mark=mark)
    runner = engine._runner

    def failing(real, prompts_at: int):  # the position of the call's prompts among its arguments
        def run(*args):
            if any(mark in prompt for prompt in args[prompts_at]):
                raise MemoryError("Unable to allocate 10.9 TiB")
            return real(*args)

        return run

    for name, prompts_at in [("decode_and_prefill", 2), ("prefill", 0), ("prefill_after", 0)]:
        setattr(runner, name, failing(getattr(runner, name), prompts_at))
    done = _finish(engine)
    hostile = next(r for r in requests if mark in r.prompt_token_ids)
    assert done[hostile.request_id].finish_reason == "abort"
    assert "10.9 TiB" in (done[hostile.request_id].error or "")
    assert engine.metrics().prefill_failures == 1
    for request in requests[1:]:
        if request is not hostile:
            _assert_greedy_as_merged(model, adapters, request, done[request.request_id])


def test_removal_drops_a_pending_replacement(model) -> None:
    engine = engine_for(model)
    engine.set_adapter(make_adapter(model, "a", rank=4, seed=1, version=1))
    request = SampleRequest(prompts([5])[0], SamplingParams(max_tokens=4, temperature=0.0), adapter="a")
    engine.add_request(request)
    engine.step()
    engine.set_adapter(make_adapter(model, "a", rank=4, seed=2, version=2))
    assert engine.adapters() == {"a": 2}
    engine.remove_adapter("a")  # before any step installed v2: the row keeps v1
    assert engine.adapters() == {}
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    assert done[request.request_id].versions == [1] * 4


def test_a_waiting_request_keeps_its_adapter_after_removal(model) -> None:
    engine = BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=1, max_seq_len_tokens=64))
    engine.set_adapter(make_adapter(model, "a", rank=4, seed=1, version=3))
    first = SampleRequest(prompts([5])[0], SamplingParams(max_tokens=3))
    waiting = SampleRequest(prompts([5])[0], SamplingParams(max_tokens=3), adapter="a")
    engine.add_request(first)
    engine.add_request(waiting)  # no free row yet: it waits
    engine.remove_adapter("a")
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    assert done[waiting.request_id].versions == [3] * 3


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_weights_is_refused(model, poison: float) -> None:
    """Served, it would poison every row of its forwards (the masked-dense form multiplies every slot's B)."""
    engine = engine_for(model)
    bad = make_adapter(model, "bad", rank=4, seed=1)
    key = sorted(k for k in bad.tensors if k.endswith("lora_B.weight"))[3]
    bad.tensors[key][2, 1] = poison
    with pytest.raises(ValueError, match=r"adapter 'bad': module .* lora_B holds NaN or infinite values"):
        engine.set_adapter(bad)
    assert engine.adapters() == {}


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_a_diverged_adapter_fails_only_its_own_requests(model, runner: str) -> None:
    """An adapter so large that its logits overflow (an optimizer step at lr 1e30) fails the requests that
    sample from it with an error that names it; the base and another adapter's rows of the same steps
    finish as if alone, and the engine serves on (also in the rows the failed ones leave)."""
    engine = engine_for(model, runner=runner)
    bad = make_adapter(model, "bad", rank=4, seed=1)
    bad.tensors = {name: t * 1e30 if name.endswith("lora_B.weight") else t for name, t in bad.tensors.items()}
    engine.set_adapter(bad)
    engine.set_adapter(make_adapter(model, "good", rank=4, seed=2))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    sampled = SamplingParams(max_tokens=6, seed=3)
    names = [None, "bad", "good", "bad", None]
    requests = [
        SampleRequest(p, greedy if i % 2 else sampled, adapter=name)
        for i, (p, name) in enumerate(zip(prompts([5, 7, 4, 6, 3]), names, strict=True))
    ]
    alone = {r.request_id: engine_for(model, runner=runner) for r in requests if r.adapter != "bad"}
    for single in alone.values():
        single.set_adapter(make_adapter(model, "good", rank=4, seed=2))
    done = {c.request_id: c for c in engine.generate(requests)}
    for request in requests:
        out = done[request.request_id]
        if request.adapter == "bad":
            assert out.finish_reason == "abort" and out.token_ids == []
            assert out.error is not None and "not finite" in out.error and "adapter 'bad'" in out.error
        else:
            [reference] = alone[request.request_id].generate([request])
            assert out.error is None and out.finish_reason == "length"
            assert out.token_ids == reference.token_ids
            assert max(abs(a - b) for a, b in zip(out.logprobs, reference.logprobs, strict=True)) < 1e-5
    again = [SampleRequest(p, greedy, adapter="good") for p in prompts([5, 6, 7, 8, 9])]
    for out in engine.generate(again):  # every row, those the failed requests held included
        assert out.error is None and len(out.token_ids) == 6


def test_a_model_with_other_layer_names_refuses_their_adapters_clearly() -> None:
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, intermediate_size=128, num_attention_heads=4
    )
    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(config).eval()
    engine = engine_for(neox)
    assert engine.runner == "hf"
    update = AdapterUpdate(
        "x",
        0,
        2,
        1.0,
        {"base_model.model.gpt_neox.layers.0.attention.dense.lora_A.weight": torch.zeros(2, 64)},
    )
    # Its attention and MLP layers have other names than Llama's: only the LM head can be adapted.
    with pytest.raises(
        ValueError, match=r"'gpt_neox\.layers\.0\.attention\.dense' is not a LoRA target.*lm_head"
    ):
        engine.set_adapter(update)
    [out] = engine.generate([SampleRequest([1, 2, 3], SamplingParams(max_tokens=2))])  # still serves the base
    assert len(out.token_ids) == 2


def test_a_device_that_is_not_there_is_one_clear_error(model) -> None:
    with pytest.raises(UserError, match=r"engine\.device='tpu'"):
        engine_for(model, device="tpu")
    assert engine_for(model, device="auto").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"engine\.device='cuda'.*no CUDA device.*cpu"):
            engine_for(model, device="cuda")
        with pytest.raises(UserError, match=r"engine\.device='cuda:1'"):
            engine_for(model, device="cuda:1")


def test_prompt_logprobs_come_from_the_prefill_pass(model, monkeypatch) -> None:
    """No second forward over the prompt: full_logits (the separate pass) is never called."""
    engine = engine_for(model)

    def forbidden(*args, **kwargs):
        raise AssertionError("a second forward over the prompt")

    monkeypatch.setattr(engine._runner, "full_logits", forbidden)
    [out] = engine.generate(
        [SampleRequest(prompts([7])[0], SamplingParams(max_tokens=1), prompt_logprobs=True)]
    )
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 7


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_bfloat16_with_adapters_stays_close_to_the_float32_reference(model, runner) -> None:
    engine = engine_for(model, dtype="bfloat16", runner=runner)
    adapter = make_adapter(model, "a", rank=4, seed=1)
    engine.set_adapter(adapter)
    prompt = prompts([9])[0]
    params = SamplingParams(max_tokens=6, seed=1, logprobs_kind="raw")
    [out] = engine.generate([SampleRequest(prompt, params, adapter="a")])
    logits = ref_logits(merged(model, adapter), prompt + out.token_ids)[len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert (torch.tensor(out.logprobs) - expected).abs().max() < 5e-2


# ---- on a GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("runner", ["fast", "hf"])
@pytest.mark.parametrize("kind", ["sampled", "raw"])
def test_on_cuda_logprobs_match_the_cpu_reference(model, runner, kind) -> None:
    """Weights, cache and sampling on the GPU; held to the float32 CPU reference (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = BuiltinEngine(
        model,
        config=BuiltinEngineConfig(max_batch_size=8, max_seq_len_tokens=64, device="cuda", runner=runner),
    )
    assert engine.device.type == "cuda"
    adapter = make_adapter(model, "a", rank=4, seed=1)
    engine.set_adapter(adapter)
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, logprobs_kind=kind)
    requests = [
        SampleRequest(p, params, adapter=n, prompt_logprobs=True)
        for p, n in zip(prompts([3, 9, 14]), [None, "a", "a"], strict=True)
    ]
    references = {None: model, "a": merged(model, adapter)}
    for r, out in zip(requests, engine.generate(requests), strict=True):
        ids = r.prompt_token_ids + out.token_ids
        logits = ref_logits(references[r.adapter], ids)
        gen = logits[len(r.prompt_token_ids) - 1 : -1]
        token = torch.tensor(out.token_ids)[:, None]
        expected = torch.log_softmax(gen if kind == "raw" else gen / 0.7, -1).gather(1, token).squeeze(1)
        assert (torch.tensor(out.logprobs) - expected).abs().max() < 1e-3
        prompt_expected = torch.log_softmax(logits[: len(r.prompt_token_ids) - 1], -1)
        prompt_expected = prompt_expected.gather(1, torch.tensor(r.prompt_token_ids[1:])[:, None]).squeeze(1)
        assert (torch.tensor(out.prompt_logprobs[1:]) - prompt_expected).abs().max() < 1e-3


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_seeded_tokens_do_not_depend_on_the_batch(model) -> None:
    def engine() -> BuiltinEngine:
        e = BuiltinEngine(
            model, config=BuiltinEngineConfig(max_batch_size=8, max_seq_len_tokens=64, device="cuda")
        )
        e.set_adapter(make_adapter(model, "a", rank=4, seed=1))
        return e

    prompt, *others = prompts([6, 3, 11])
    seeded = SampleRequest(prompt, SamplingParams(max_tokens=12, seed=42), adapter="a")
    alone = engine().generate([copy.deepcopy(seeded)])[0].token_ids
    mixed = [SampleRequest(p, SamplingParams(max_tokens=12)) for p in others]
    assert engine().generate([mixed[0], seeded, mixed[1]])[1].token_ids == alone
