"""Trainer: micro-batching is exact gradient accumulation; checkpoints restore model, optimizer, step.

Reference: the same loss computed in one batch (naive) vs in micro-batches; torch AdamW state dicts.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from inflight.models import load_model
from inflight.trainer import LossConfig, MicroBatch, Trainer, TrainerConfig
from inflight.trainer.checkpoint import load_checkpoint, save_checkpoint
from inflight.trainer.config import lr_at
from inflight.trainer.trainer import sampled_by
from inflight.types import TrainSample


def make_samples(n: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(5, 20)
        prompt = rng.randint(2, length - 2)
        mask = [0.0] * prompt + [1.0] * (length - prompt)
        samples.append(
            TrainSample(
                token_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behaviour_logprobs=[-rng.uniform(0.5, 5.0) * m for m in mask],
                advantages=[rng.uniform(-1, 1) * m for m in mask],
                versions=[0 if m else -1 for m in mask],
            )
        )
    return samples


def grads_after(
    model_dir: Path, samples: list[TrainSample], micro: int, reduction: str
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = load_model(model_dir)
    cfg = TrainerConfig(micro_batch_size=micro, loss=LossConfig(name="ppo", reduction=reduction))  # type: ignore[arg-type]
    trainer = Trainer(model, cfg)
    trainer.forward_backward(samples)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reduction", ["token_mean", "token_sum", "seq_mean"])
def test_micro_batching_equals_one_batch(tiny_model_dir: Path, reduction: str) -> None:
    samples = make_samples(10, vocab=2048)
    full = grads_after(tiny_model_dir, samples, micro=10, reduction=reduction)
    split = grads_after(tiny_model_dir, samples, micro=3, reduction=reduction)
    assert full.keys() == split.keys() and full
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_collate_shifts_targets() -> None:
    s = TrainSample([5, 6, 7], [0.0, 1.0, 1.0], [0.0, -1.0, -2.0], [0.0, 0.5, 0.5], [-1, 0, 0])
    t = TrainSample([8, 9], [0.0, 1.0], [0.0, -3.0], [0.0, 1.0], [-1, 0])
    mb = MicroBatch.collate([s, t], pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6], [8, 0]]
    assert mb.targets.tolist() == [[6, 7], [9, 0]]
    assert mb.mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb.behaviour_logprobs.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]


def test_step_changes_weights_and_counts_versions(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    trainer = Trainer(model, TrainerConfig(lr=1e-3))
    before = {k: v.clone() for k, v in trainer.weights().items()}
    metrics = trainer.train_step(make_samples(4, vocab=2048))
    assert trainer.version == 1
    assert metrics["grad_norm"] > 0 and metrics["num_tokens"] > 0
    changed = [k for k, v in trainer.weights().items() if not torch.equal(v, before[k])]
    assert changed, "an optimizer step must change the weights"


def test_kl_penalty_uses_frozen_reference(tiny_model_dir: Path) -> None:
    trainer = Trainer(load_model(tiny_model_dir), TrainerConfig(lr=1e-2, loss=LossConfig(kl_coef=0.5)))
    samples = make_samples(4, vocab=2048)
    first = trainer.train_step(samples)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    second = trainer.train_step(samples)
    assert second["kl"] > 0  # the policy moved, the reference did not
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_checkpoint_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(6, vocab=2048)
    trainer = Trainer(load_model(tiny_model_dir), TrainerConfig(lr=1e-3))
    for _ in range(2):
        trainer.train_step(samples)
    save_checkpoint(trainer, tmp_path / "ckpt", extra={"step": 2})

    restored = Trainer(load_model(tiny_model_dir), TrainerConfig(lr=1e-3))
    meta = load_checkpoint(restored, tmp_path / "ckpt")
    assert meta["step"] == 2 and restored.version == 2
    for k, v in trainer.weights().items():
        assert torch.equal(v, restored.weights()[k]), k
    # Same optimizer state -> the next step is identical.
    trainer.train_step(samples)
    restored.train_step(samples)
    for k, v in trainer.weights().items():
        torch.testing.assert_close(restored.weights()[k], v, rtol=0, atol=1e-7, msg=k)
    # A second save replaces the first atomically.
    save_checkpoint(trainer, tmp_path / "ckpt", extra={"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_trained_position_logprobs_match_a_full_forward(tiny_model_dir: Path) -> None:
    """The trainer runs the LM head only where the loss looks; the logprobs must equal a naive forward."""
    model = load_model(tiny_model_dir)
    samples = make_samples(5, vocab=2048, seed=3)
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.token_ids])).logits[0, :-1]
            targets = torch.tensor(s.token_ids[1:])[:, None]
            lp = torch.log_softmax(logits.double(), -1).gather(1, targets)[:, 0]
            s.behaviour_logprobs = [0.0] + [float(x) * m for x, m in zip(lp, s.loss_mask[1:], strict=True)]
    metrics = Trainer(model, TrainerConfig(micro_batch_size=2)).forward_backward(samples)
    assert metrics["logprob_diff_max_abs"] < 1e-5
    assert metrics["is_weight_min"] == pytest.approx(1.0, abs=1e-4)


def test_sampled_by_marks_whole_replies_of_one_version() -> None:
    mask = [0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    versions = [-1, 3, 3, -1, -1, 3, 4, 4, -1, 4]
    # Reply 1 is all version 3; reply 2 changed weights mid-reply (a stale KV prefix for its later tokens).
    assert sampled_by(versions, mask, 3) == [False, True, True] + [False] * 7
    assert sampled_by(versions, mask, 4) == [False] * 9 + [True]
    assert sampled_by(versions, mask, None) == [False] * 10


def test_logprob_parity_is_measured_on_the_trainers_own_tokens_only(tiny_model_dir: Path) -> None:
    """Stale tokens differ from the trainer by the policy change; tokens of its own version must not."""
    model = load_model(tiny_model_dir)
    samples = make_samples(6, vocab=2048, seed=4)
    with torch.no_grad():
        for i, s in enumerate(samples):
            logits = model(input_ids=torch.tensor([s.token_ids])).logits[0, :-1]
            targets = torch.tensor(s.token_ids[1:])[:, None]
            lp = torch.log_softmax(logits.double(), -1).gather(1, targets)[:, 0]
            stale = i % 2 == 1  # sampled by version 7 of other weights: shifted logprobs
            s.behaviour_logprobs = [0.0] + [
                (float(x) - 0.3 * stale) * m for x, m in zip(lp, s.loss_mask[1:], strict=True)
            ]
            s.versions = [(7 if stale else 0) if m else -1 for m in s.loss_mask]
    metrics = Trainer(model, TrainerConfig(micro_batch_size=4)).forward_backward(samples)
    assert metrics["logprob_diff_max_abs"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["logprob_parity_max_abs"] < 1e-5
    own = sum(sum(s.loss_mask[1:]) for i, s in enumerate(samples) if i % 2 == 0)
    assert metrics["logprob_parity_token_frac"] == pytest.approx(own / metrics["num_tokens"])


def test_samples_without_trained_tokens_are_skipped_not_fatal(tiny_model_dir: Path) -> None:
    trainer = Trainer(load_model(tiny_model_dir), TrainerConfig(micro_batch_size=2))
    empty = TrainSample([5, 6, 7], [0.0, 0.0, 0.0], [0.0] * 3, [0.0] * 3, [-1] * 3)
    samples = [empty, empty, *make_samples(3, vocab=2048)]  # the two empty ones share a micro-batch
    metrics = trainer.forward_backward(samples)
    assert metrics["num_samples"] == 5.0 and metrics["num_tokens"] > 0
    assert any(p.grad is not None for p in trainer.model.parameters())


def test_linear_lr_schedule_values() -> None:
    cfg = TrainerConfig(lr=1e-3, lr_schedule="linear", lr_final_frac=0.1, lr_decay_steps=10)
    assert lr_at(cfg, 0) == pytest.approx(1e-3)
    assert lr_at(cfg, 5) == pytest.approx(1e-3 * (1 - 0.9 * 0.5))
    assert lr_at(cfg, 10) == pytest.approx(1e-4)
    assert lr_at(cfg, 50) == pytest.approx(1e-4)  # flat after the decay
    assert lr_at(TrainerConfig(lr=2e-4), 123) == 2e-4
    with pytest.raises(ValueError, match="lr_decay_steps"):
        lr_at(TrainerConfig(lr_schedule="linear"), 0)
    with pytest.raises(ValueError, match="lr_final_frac"):
        TrainerConfig(lr_final_frac=1.5)


def test_the_schedule_drives_the_optimizer_and_survives_a_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = TrainerConfig(
        lr=1e-3, lr_schedule="linear", lr_final_frac=0.0, lr_decay_steps=4, micro_batch_size=8
    )
    trainer = Trainer(load_model(tiny_model_dir), cfg)
    samples = make_samples(4, vocab=2048)
    lrs = [trainer.train_step(samples)["lr"] for _ in range(2)]
    assert lrs == pytest.approx([1e-3, 0.75e-3])
    save_checkpoint(trainer, tmp_path / "ckpt")
    restored = Trainer(load_model(tiny_model_dir), cfg)
    load_checkpoint(restored, tmp_path / "ckpt")
    assert restored.train_step(samples)["lr"] == pytest.approx(0.5e-3)
    assert restored.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    with pytest.raises(ValueError, match="lr_decay_steps"):
        Trainer(load_model(tiny_model_dir), TrainerConfig(lr_schedule="linear"))
