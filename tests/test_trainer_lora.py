"""The one trainer core: LoRA and full-parameter training in the pipeline's Trainer, micro-batches by a
token budget, gradient checkpointing, reference log-probs, devices, and the checkpoint formats.

References: one big batch for micro-batching; the same step without checkpointing; the bare Hugging Face
model (for the base and for reloaded checkpoints) and `peft.PeftModel` over it for adapters; the explicit
merge W + (alpha / r) B A for merged weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inflight.errors import UserError
from inflight.models import load_model
from inflight.models.device import resolve_device
from inflight.trainer import LossConfig, Trainer, TrainerConfig
from inflight.trainer.checkpoint import load_checkpoint, save_checkpoint
from inflight.trainer.micro_batches import pack_by_tokens
from inflight.types import TrainSample
from test_trainer import make_samples

VOCAB = 2048


def _lora(**overrides: object) -> TrainerConfig:
    return TrainerConfig(lr=1e-2, lora_rank=4, lora_alpha=8.0, **overrides)  # type: ignore[arg-type]


def _hf_logprobs(model: torch.nn.Module, samples: list[TrainSample]) -> list[torch.Tensor]:
    """[T] log p(token_t | tokens_<t), 0 at t = 0: the naive per-sample forward."""
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.token_ids])).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids[1:])[:, None])[:, 0]
            out.append(torch.cat([lp.new_zeros(1), lp]).float())
    return out


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {f"p{i}": p.grad.clone() for i, p in enumerate(trainer.policy.parameters()) if p.grad is not None}


def _policy_logprobs(trainer: Trainer, samples: list[TrainSample]) -> list[torch.Tensor]:
    """The trained policy's log-probs, through the Trainer's own routing (all positions)."""
    out = []
    with torch.no_grad():
        for s in samples:
            with trainer.policy.routing(1):
                logits = trainer.model(input_ids=torch.tensor([s.token_ids])).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids[1:])[:, None])[:, 0]
            out.append(torch.cat([lp.new_zeros(1), lp]).float())
    return out


# ---- micro-batches by tokens ---------------------------------------------------------------------------


def test_pack_by_tokens_bounds_padded_tokens_and_rows_and_keeps_every_row() -> None:
    lengths = [5, 17, 3, 9, 9, 40, 1, 12]
    for max_tokens, max_rows in [(20, None), (36, 2), (None, 3), (1, None)]:
        batches = pack_by_tokens(lengths, max_tokens, max_rows)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for batch in batches:
            padded = len(batch) * max(lengths[i] for i in batch)
            assert max_tokens is None or padded <= max_tokens or len(batch) == 1  # a long row goes alone
            assert max_rows is None or len(batch) <= max_rows
    assert pack_by_tokens(lengths, None, None) == [sorted(range(8), key=lambda i: -lengths[i])]


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean"])
def test_token_budget_micro_batching_equals_one_batch(tiny_model_dir: Path, lora_rank: int, reduction: str):
    samples = make_samples(10, vocab=VOCAB)
    loss = LossConfig(name="ppo", reduction=reduction)  # type: ignore[arg-type]

    def grads(**batching: object) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        config = TrainerConfig(lora_rank=lora_rank, loss=loss, **batching)  # type: ignore[arg-type]
        trainer = Trainer(load_model(tiny_model_dir), config)
        if lora_rank:  # a fresh adapter has B = 0, so A gets no gradient: give B values
            with torch.no_grad():
                for p in trainer.policy.parameters()[1::2]:
                    p.normal_(std=0.02, generator=torch.Generator().manual_seed(1))
        trainer.forward_backward(samples)
        return _grads(trainer)

    full = grads(micro_batch_size=10)
    split = grads(micro_batch_size=10, micro_batch_tokens=40)  # 19-token rows: 2 per micro-batch at most
    assert full.keys() == split.keys() and full
    assert sum(float(g.abs().sum()) for g in full.values()) > 0
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-4, atol=1e-6, msg=name)


# ---- gradient checkpointing ------------------------------------------------------------------------------


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir: Path, lora_rank: int) -> None:
    samples = make_samples(6, vocab=VOCAB, seed=2)

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        config = TrainerConfig(lora_rank=lora_rank, micro_batch_size=3, gradient_checkpointing=checkpointing)
        trainer = Trainer(load_model(tiny_model_dir), config)
        if lora_rank:
            with torch.no_grad():
                for p in trainer.policy.parameters()[1::2]:
                    p.normal_(std=0.02, generator=torch.Generator().manual_seed(1))
        model = trainer.model
        active = getattr(model, "is_activation_checkpointing", None)
        if active is None:  # transformers before 5's rename
            active = model.is_gradient_checkpointing
        assert active == checkpointing
        trainer.forward_backward(samples)
        return _grads(trainer)

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys() and plain
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


# ---- LoRA in the pipeline's trainer ----------------------------------------------------------------------


def test_lora_trains_only_the_adapter_and_the_base_stays_the_reference(tiny_model_dir: Path) -> None:
    base = load_model(tiny_model_dir)
    samples = make_samples(6, vocab=VOCAB, seed=5)
    expected_base = _hf_logprobs(base, samples)
    trainer = Trainer(load_model(tiny_model_dir), _lora(loss=LossConfig(kl_coef=0.5)))
    assert trainer.ref_model is None  # no copy: the base is the reference
    before = {k: v.clone() for k, v in trainer.weights().items()}
    # A fresh adapter is the base model (B = 0), in the trainer's own forward.
    for got, want in zip(_policy_logprobs(trainer, samples), expected_base, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    first = trainer.train_step(samples)
    second = trainer.train_step(samples)
    assert trainer.version == 2 and first["grad_norm"] > 0
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 0
    # The base weights never moved: the reference log-probs are still the bare model's.
    for got, want in zip(trainer.reference_logprobs(samples), expected_base, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert all(not p.requires_grad for p in trainer.model.parameters())
    moved = [p for p in _policy_logprobs(trainer, samples)]
    assert max(float((m - e).abs().max()) for m, e in zip(moved, expected_base, strict=True)) > 1e-3
    # weights(): the merged model W + (alpha / r) B A, which the bare HF model reproduces.
    merged = trainer.weights()
    assert merged.keys() == before.keys()  # Hugging Face names, no `.base.`
    assert any(not torch.equal(merged[k], before[k]) for k in merged)
    hf = load_model(tiny_model_dir)
    hf.load_state_dict(merged)
    for got, want in zip(_hf_logprobs(hf, samples), moved, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_adapter_update_carries_the_adapter_under_peft_names(tiny_model_dir: Path) -> None:
    trainer = Trainer(load_model(tiny_model_dir), _lora(lora_target_modules=("q_proj", "v_proj")))
    trainer.train_step(make_samples(4, vocab=VOCAB))
    update = trainer.adapter_update()
    assert (update.version, update.rank, update.scale) == (1, 4, 2.0)
    adapter = trainer.policy.trained.adapter  # type: ignore[attr-defined]
    assert sorted(update.tensors) == sorted(key for key, _ in adapter.named_parameters())
    assert all(k.startswith("base_model.model.") and ("q_proj" in k or "v_proj" in k) for k in update.tensors)
    for key, t in adapter.named_parameters():
        assert torch.equal(update.tensors[key], t.detach()) and not update.tensors[key].requires_grad
    with pytest.raises(UserError, match="full model"):
        Trainer(load_model(tiny_model_dir), TrainerConfig()).adapter_update()


def test_reference_logprobs_of_a_full_trainer_are_the_frozen_copy(tiny_model_dir: Path) -> None:
    samples = make_samples(4, vocab=VOCAB, seed=8)
    expected = _hf_logprobs(load_model(tiny_model_dir), samples)
    trainer = Trainer(load_model(tiny_model_dir), TrainerConfig(lr=1e-2, loss=LossConfig(kl_coef=0.1)))
    trainer.train_step(samples)
    for got, want in zip(trainer.reference_logprobs(samples), expected, strict=True):
        assert got.shape == (len(want),)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(UserError, match="kl_coef"):
        Trainer(load_model(tiny_model_dir), TrainerConfig()).reference_logprobs(samples)


# ---- checkpoints: one format per kind ------------------------------------------------------------------


def test_a_lora_run_checkpoint_is_a_peft_adapter_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path):
    from peft import PeftModel

    samples = make_samples(6, vocab=VOCAB, seed=6)
    trainer = Trainer(load_model(tiny_model_dir), _lora())
    for _ in range(2):
        trainer.train_step(samples)
    path = save_checkpoint(trainer, tmp_path / "ckpt", extra={"step": 2})
    assert (path / "model.safetensors").exists() is False
    assert json.loads((path / "adapter_config.json").read_text())["lora_alpha"] == 8.0

    peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir), str(path)).eval()
    for got, want in zip(_hf_logprobs(peft_model, samples), _policy_logprobs(trainer, samples), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    restored = Trainer(load_model(tiny_model_dir), _lora())
    assert load_checkpoint(restored, path)["step"] == 2 and restored.version == 2
    trainer.train_step(samples)
    restored.train_step(samples)  # same AdamW moments -> the same step
    for got, want in zip(restored.policy.parameters(), trainer.policy.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    with pytest.raises(UserError, match=r"LoRA adapter, but trainer\.lora_rank=0"):
        load_checkpoint(Trainer(load_model(tiny_model_dir), TrainerConfig()), path)


def test_a_full_run_checkpoint_is_a_hugging_face_model_directory(tiny_model_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    samples = make_samples(4, vocab=VOCAB, seed=7)
    trainer = Trainer(load_model(tiny_model_dir), TrainerConfig(lr=1e-2))
    trainer.train_step(samples)
    path = save_checkpoint(trainer, tmp_path / "ckpt", extra={"step": 1})
    reloaded = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    trainer.model.eval()
    for got, want in zip(_hf_logprobs(reloaded, samples), _hf_logprobs(trainer.model, samples), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(UserError, match=r"full model, but trainer\.lora_rank=4"):
        load_checkpoint(Trainer(load_model(tiny_model_dir), _lora()), path)


# ---- devices and config --------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_device_that_is_not_there_is_one_clear_error(tiny_model_dir: Path) -> None:
    with pytest.raises(
        UserError, match=r"trainer.device='cuda' but this machine has no CUDA.*trainer.device=cpu"
    ):
        Trainer(load_model(tiny_model_dir), TrainerConfig(device="cuda"))
    with pytest.raises(UserError, match="not a device name"):
        resolve_device("gpu0", "trainer.device")
    assert resolve_device("auto") == torch.device("cpu")


def test_bfloat16_autocast_follows_the_device_and_stays_close(tiny_model_dir: Path) -> None:
    samples = make_samples(4, vocab=VOCAB, seed=9)
    for s, lp in zip(samples, _hf_logprobs(load_model(tiny_model_dir), samples), strict=True):
        s.behaviour_logprobs = [float(x) * m for x, m in zip(lp, s.loss_mask, strict=True)]
    metrics = Trainer(load_model(tiny_model_dir), TrainerConfig(autocast_bf16=True)).forward_backward(samples)
    assert 0 < metrics["logprob_diff_max_abs"] < 0.1  # bfloat16 rounding: not exact, not far


def test_config_checks_name_the_fix() -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        TrainerConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="lora_target_modules must be a non-empty subset"):
        TrainerConfig(lora_rank=4, lora_target_modules=("qproj",))
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        TrainerConfig(lora_rank=-1)


# ---- on a GPU --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_on_cuda_the_trainer_matches_the_cpu_reference_and_trains(tiny_model_dir: Path, lora_rank: int):
    samples = make_samples(8, vocab=VOCAB, seed=11)
    for s, lp in zip(samples, _hf_logprobs(load_model(tiny_model_dir), samples), strict=True):
        s.behaviour_logprobs = [float(x) * m for x, m in zip(lp, s.loss_mask, strict=True)]
    config = TrainerConfig(lr=1e-3, device="cuda", lora_rank=lora_rank, micro_batch_tokens=64)
    trainer = Trainer(load_model(tiny_model_dir), config)
    assert next(trainer.model.parameters()).device.type == "cuda"
    first = trainer.train_step(samples)
    assert first["logprob_diff_max_abs"] < 1e-3  # float32 kernels on the GPU vs the CPU reference
    for _ in range(2):
        metrics = trainer.train_step(samples)
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    assert trainer.version == 3
    assert all(t.device.type == "cuda" for t in trainer.weights().values())


# ---- the adapter set itself ------------------------------------------------------------------------------


def test_an_adapter_set_routes_each_row_to_its_own_adapter(tiny_model_dir: Path) -> None:
    from inflight.trainer.adapters import AdapterSet
    from inflight.trainer.types import LoraSpec

    adapters = AdapterSet(load_model(tiny_model_dir), torch.device("cpu"), max_rank=8)
    for name, seed in (("a", 1), ("b", 2)):
        trained = adapters.create(name, LoraSpec(rank=4, seed=seed))
        with torch.no_grad():  # nonzero B: distinct adapters
            for p in trained.adapter.parameters()[1::2]:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(seed))
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with adapters.routing(["a", None, "b"]):
            mixed = adapters.model(input_ids=ids).logits
        for row, name in enumerate(["a", None, "b"]):
            with adapters.routing([name]):
                alone = adapters.model(input_ids=ids[row : row + 1]).logits[0]
            torch.testing.assert_close(mixed[row], alone, rtol=1e-5, atol=1e-5)
        bare = load_model(tiny_model_dir)(input_ids=ids[1:2]).logits[0]
    torch.testing.assert_close(mixed[1], bare, rtol=1e-5, atol=1e-5)  # None: the bare base
    assert not torch.allclose(mixed[0], mixed[2], atol=1e-3)
    assert adapters.adapter_update("b").version == 0 and sorted(adapters.base_weights()) == sorted(
        load_model(tiny_model_dir).state_dict()
    )
    adapters.remove("a")
    with pytest.raises(UserError, match="unknown model 'a'"):
        adapters.get("a")
    with pytest.raises(UserError, match="already exists"):
        adapters.create("b", LoraSpec(rank=4))
    with pytest.raises(UserError, match="between 1 and 8"):
        adapters.create("c", LoraSpec(rank=16))
