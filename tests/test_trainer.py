"""Trainer: micro-batching is exact gradient accumulation; checkpoints restore model, optimizer, step.

Reference: the same loss computed in one batch (naive) vs in micro-batches; torch AdamW state dicts.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import transformers

from inflight.models import load_model
from inflight.trainer import LossConfig, MicroBatch, Trainer, TrainerConfig
from inflight.trainer.batch_layout import packing_is_exact, sampled_by, shared_prefixes_are_exact
from inflight.trainer.checkpoint import load_checkpoint, save_checkpoint
from inflight.trainer.config import lr_at
from inflight.trainer.micro_batches import group_by_total_tokens, pack_rows, shared_prefix_groups
from inflight.trainer.trainer import through_last_trained
from inflight.types import TrainSample


def make_grouped_samples(prompts: int, group: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    """GRPO-shaped samples: `group` samples of each of `prompts` prompts (each sharing its prompt and a
    chat header with every other), replies and environment tokens after it; plus a sample identical to
    another (their common prefix covers trained tokens) and one that is a prefix of another."""
    rng = random.Random(seed)
    header = [rng.randrange(vocab) for _ in range(3)]
    samples = []
    for _ in range(prompts):
        prompt = header + [rng.randrange(vocab) for _ in range(rng.randint(4, 12))]
        for _ in range(group):
            tail = [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
            trained = [0.0] * len(prompt) + [1.0 if t % 3 else 0.0 for t in range(len(tail))]
            trained[len(prompt)] = 1.0
            samples.append(
                TrainSample(
                    token_ids=prompt + tail,
                    loss_mask=trained,
                    behaviour_logprobs=[-rng.uniform(0.5, 5.0) * m for m in trained],
                    advantages=[rng.uniform(-1, 1) * m for m in trained],
                    versions=[0 if m else -1 for m in trained],
                )
            )
    twin = samples[1]
    samples.append(TrainSample(**{k: list(v) for k, v in vars(twin).items()}))
    longer = samples[2]
    cut = len(longer.token_ids) - 1  # the same tokens but the last: a prefix of `longer`
    samples.append(TrainSample(**{k: list(v)[:cut] for k, v in vars(longer).items()}))
    return samples


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


# ---- sequence packing ------------------------------------------------------------------------------------


def test_pack_rows_fills_rows_first_fit_and_keeps_every_sequence() -> None:
    lengths = [5, 17, 3, 9, 9, 40, 1, 12]
    rows = pack_rows(lengths, capacity=20)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    for row in rows:
        assert sum(lengths[i] for i in row) <= 20 or len(row) == 1  # the 40 goes alone
    assert len(rows) == 4  # 40 | 17+3 | 12+5+1 | 9+9: nothing better exists for 96 tokens in rows of 20
    groups = group_by_total_tokens(lengths, max_tokens=30, max_sequences=3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) <= 3 and (sum(lengths[i] for i in group) <= 30 or len(group) == 1)


def test_collate_packs_samples_end_to_end_with_restarting_positions() -> None:
    samples = make_samples(5, vocab=50, seed=3)
    mb = MicroBatch.collate(samples, pack=True)
    assert mb.packed_ids is not None and mb.packed_positions is not None and mb.packed_flat is not None
    width = max(len(s.token_ids) for s in samples) - 1
    assert mb.packed_ids.shape[1] == width and mb.rows < len(samples)  # fewer rows than samples
    _laid_out(mb, samples)


def _laid_out(mb: MicroBatch, samples: list[TrainSample]) -> list[torch.Tensor]:
    """Each sample's indices in the packed rows, checked to hold its tokens at their own positions."""
    assert mb.packed_ids is not None and mb.packed_positions is not None and mb.packed_flat is not None
    flat_ids, flat_pos = mb.packed_ids.view(-1), mb.packed_positions.view(-1)
    indices = []
    for b, s in enumerate(samples):
        n = len(s.token_ids) - 1
        index = mb.packed_flat[b, :n]
        assert flat_ids[index].tolist() == s.token_ids[:-1]
        assert flat_pos[index].tolist() == list(range(n))
        indices.append(index)
    return indices


def _regularised_ppo(reduction: str) -> LossConfig:
    """PPO with every term the trainer adds: the top-k entropy bonus and the exact KL to the reference."""
    return LossConfig(
        name="ppo",
        reduction=reduction,  # type: ignore[arg-type]
        entropy_coef=0.1,
        entropy_top_k=3,
        kl_coef=0.1,
        kl_estimator="exact_ref",
    )


def _step_grads(
    model_dir: Path, samples: list[TrainSample], config: TrainerConfig
) -> tuple[dict[str, float], dict[str, torch.Tensor], Trainer]:
    """One forward_backward's metrics and gradients (a LoRA adapter's B made nonzero so A gets one too)."""
    torch.manual_seed(0)
    trainer = Trainer(load_model(model_dir), config)
    if config.lora_rank:  # a fresh adapter has B = 0: give B values so that A gets a gradient too
        with torch.no_grad():
            for p in trainer.policy.parameters()[1::2]:
                p.normal_(std=0.02, generator=torch.Generator().manual_seed(1))
    metrics = trainer.forward_backward(samples)
    params = trainer.policy.parameters()
    return metrics, {str(i): p.grad.clone() for i, p in enumerate(params) if p.grad is not None}, trainer


def _assert_same_step(
    got: tuple[dict[str, float], dict[str, torch.Tensor]],
    want: tuple[dict[str, float], dict[str, torch.Tensor]],
) -> None:
    (got_metrics, got_grads), (want_metrics, want_grads) = got, want
    assert want_grads.keys() == got_grads.keys() and want_grads
    assert sum(float(g.abs().sum()) for g in want_grads.values()) > 0
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for key in ("loss", "entropy", "kl", "logprob_diff_mean_abs"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean"])
def test_packing_gives_the_gradients_of_padding(tiny_model_dir: Path, lora_rank: int, reduction: str) -> None:
    """Every term the trainer adds over packed rows against right-padded ones, micro-batched differently."""
    samples = make_samples(12, vocab=2048, seed=4)
    loss = _regularised_ppo(reduction)
    steps = {}
    for packing, micro in ((False, 12), (True, 5)):
        config = TrainerConfig(micro_batch_size=micro, loss=loss, packing=packing, lora_rank=lora_rank)
        metrics, grads, trainer = _step_grads(tiny_model_dir, samples, config)
        assert trainer.packing is packing
        steps[packing] = (metrics, grads)
    _assert_same_step(steps[True], steps[False])


def test_samples_that_begin_alike_are_grouped_to_share_their_prefix() -> None:
    samples = make_grouped_samples(prompts=3, group=4, vocab=50, seed=6)
    seqs = [s.token_ids[:-1] for s in samples]
    groups = shared_prefix_groups(seqs, max_tokens=1000)
    assert sorted(i for g in groups for i in g.members) == list(range(len(seqs)))
    for g in groups:
        first = seqs[g.members[0]]
        assert all(seqs[i][: g.shared] == first[: g.shared] for i in g.members)
    by_prompt = sorted(sorted(g.members) for g in groups)
    assert by_prompt[0][:4] == [0, 1, 2, 3] and len(groups) == 3  # one group per prompt, not per header
    # The layout's budget splits a group rather than exceed it.
    tight = shared_prefix_groups(seqs, max_tokens=30)
    assert all(g.laid_out_length([len(x) for x in seqs]) <= 30 or len(g.members) == 1 for g in tight)
    assert len(tight) > len(groups)


def test_collate_lays_a_shared_prefix_out_once() -> None:
    samples = make_grouped_samples(prompts=3, group=4, vocab=50, seed=7)
    plain = MicroBatch.collate(samples, pack=True)
    mb = MicroBatch.collate(samples, pack=True, share_prefixes=True)
    assert mb.packed_ids is not None and mb.packed_positions is not None and mb.packed_flat is not None
    assert mb.packed_mask is not None and plain.packed_mask is None
    assert mb.forward_tokens < plain.forward_tokens == sum(len(s.token_ids) - 1 for s in samples)
    width = mb.packed_ids.shape[1]
    for index in _laid_out(mb, samples):
        # Each token sees exactly the tokens of its own sample before it (and itself).
        for t in range(len(index)):
            row, col = divmod(int(index[t]), width)
            seen = mb.packed_mask[row, 0, col].nonzero().view(-1) + row * width
            assert sorted(seen.tolist()) == sorted(index[: t + 1].tolist())


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean"])
def test_shared_prefixes_give_the_gradients_of_padding(
    tiny_model_dir: Path, lora_rank: int, reduction: str
) -> None:
    """Every term the trainer adds over shared-prefix rows against right-padded ones: GRPO groups, a
    duplicated sample and a sample that is another's prefix."""
    samples = make_grouped_samples(prompts=3, group=4, vocab=2048, seed=8)
    loss = _regularised_ppo(reduction)
    steps = {}
    for share in (False, True):
        config = TrainerConfig(loss=loss, packing=share, share_prefixes=share, lora_rank=lora_rank)
        metrics, grads, trainer = _step_grads(tiny_model_dir, samples, config)
        assert trainer.share_prefixes is share
        steps[share] = (metrics, grads)
    _assert_same_step(steps[True], steps[False])
    assert steps[True][0]["forward_tokens"] < 0.6 * steps[False][0]["forward_tokens"]


class _IgnoresAttentionMasks(torch.nn.Module):
    """A causal LM that separates sequences only where positions restart at 0 (each token's logits: the
    running mean of the embeddings since the last position 0) and ignores any attention mask: packing
    works, shared prefixes do not."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 11})()
        self.embed = torch.nn.Embedding(11, 11)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **_: object
    ) -> object:
        positions = torch.arange(input_ids.shape[1])[None] if position_ids is None else position_ids
        h = self.embed(input_ids)
        out = torch.zeros_like(h)
        for row in range(h.shape[0]):
            total, count = torch.zeros(h.shape[-1]), 0
            for t in range(h.shape[1]):
                if positions[row, t] == 0:
                    total, count = torch.zeros(h.shape[-1]), 0
                total, count = total + h[row, t], count + 1
                out[row, t] = total / count
        return type("Out", (), {"logits": out})()


def test_a_model_that_ignores_attention_masks_packs_without_sharing() -> None:
    model = _IgnoresAttentionMasks()
    assert packing_is_exact(model, torch.device("cpu"))
    with pytest.warns(UserWarning, match="packs without sharing prefixes"):
        assert not shared_prefixes_are_exact(model, torch.device("cpu"))


def test_the_tiny_model_honours_shared_prefixes(tiny_model_dir: Path) -> None:
    assert shared_prefixes_are_exact(load_model(tiny_model_dir), torch.device("cpu"))


class _MixesPackedSequences(torch.nn.Module):
    """A causal LM that ignores positions: each token's logits are the running mean of all embeddings before
    it in its row, so packed sequences see each other."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 11})()
        self.embed = torch.nn.Embedding(11, 11)

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        h = self.embed(input_ids).cumsum(dim=1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return type("Out", (), {"logits": h})()


def test_a_model_that_mixes_packed_sequences_is_found_and_padded() -> None:
    with pytest.warns(UserWarning, match="training pads instead"):
        assert not packing_is_exact(_MixesPackedSequences(), torch.device("cpu"))


def test_the_tiny_model_honours_packing(tiny_model_dir: Path) -> None:
    assert packing_is_exact(load_model(tiny_model_dir), torch.device("cpu"))


def test_tokens_after_the_last_trained_one_are_not_computed_and_change_nothing(tiny_model_dir: Path) -> None:
    samples = make_samples(4, vocab=2048, seed=5)
    tails = [
        TrainSample(
            token_ids=s.token_ids + [7] * 9,  # e.g. an environment's closing message
            loss_mask=s.loss_mask + [0.0] * 9,
            behaviour_logprobs=s.behaviour_logprobs + [0.0] * 9,
            advantages=s.advantages + [0.0] * 9,
            versions=s.versions + [-1] * 9,
        )
        for s in samples
    ]
    assert [through_last_trained(t).token_ids for t in tails] == [s.token_ids for s in samples]
    untrained = TrainSample([1, 2, 3], [0.0, 0.0, 0.0], [0.0] * 3, [0.0] * 3, [-1] * 3)
    assert through_last_trained(untrained) is untrained

    def grads(batch: list[TrainSample]) -> list[torch.Tensor]:
        model = load_model(tiny_model_dir)
        Trainer(model, TrainerConfig(packing=False)).forward_backward(batch)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads(tails), grads(samples), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefixes"])
def test_the_last_layer_trimmed_to_trained_positions_gives_the_full_step(
    tiny_model_dir: Path, layout: str
) -> None:
    """`trainer.trim_last_layer`: the last layer's MLP only where the loss reads the hidden states. The
    same metrics and gradients as the full layer (the KL reference's forward trimmed too), and the MLP
    really saw fewer positions. Grouped samples: trained tokens inside a shared prefix included."""
    samples = make_grouped_samples(prompts=3, group=4, vocab=2048, seed=8)
    steps, mlp_rows = {}, {}
    for trim in (False, True):
        config = TrainerConfig(
            micro_batch_size=64,
            loss=_regularised_ppo("token_mean"),
            packing=layout != "padded",
            share_prefixes=layout == "shared_prefixes",
            trim_last_layer=trim,
        )
        rows: list[int] = []
        torch.manual_seed(0)
        trainer = Trainer(load_model(tiny_model_dir), config)
        for model in (trainer.model, trainer.ref_model):
            assert model is not None
            mlp = model.get_decoder().layers[-1].mlp
            mlp.register_forward_hook(
                lambda m, args, out, rows=rows: rows.append(args[0].numel() // args[0].shape[-1])
            )
        metrics = trainer.forward_backward(samples)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        steps[trim], mlp_rows[trim] = (metrics, grads), sum(rows)
    _assert_same_step(steps[True], steps[False])
    trained = sum(1 for s in samples for m in s.loss_mask[1:] if m)  # the loss's positions, per sample
    assert mlp_rows[True] <= 2 * trained < mlp_rows[False]  # policy and reference: at most the trained ones


@pytest.mark.parametrize("window", [12, 24])
def test_a_sliding_window_model_shares_prefixes_only_where_its_window_changes_nothing(window: int) -> None:
    """Mistral with a sliding window: the shared-prefix layout's 4D mask cannot slide, so a micro-batch
    shares prefixes only when every sequence fits in the window (24: all do, though a shared row is
    longer; 12: the longest do not, and the batch is packed without sharing). Either way the step is the
    padded one's. 12 passes the trainer's start-up probe (sequences of up to 11 tokens), which is how a
    QA pass found Mistral and Qwen2 models with windows of 48-64 trained on wrong logprobs."""
    samples = make_grouped_samples(prompts=3, group=4, vocab=512, seed=9)
    longest = max(len(s.token_ids) for s in samples) - 1
    row = MicroBatch.collate(samples, pack=True, share_prefixes=True).packed_ids
    assert row is not None and 12 < longest <= 24 < row.shape[1]
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=window, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config)
    steps = {}
    for layout, (packing, share) in {
        "padded": (False, False),
        "packed": (True, False),
        "shared": (True, True),
    }.items():
        loss = _regularised_ppo("token_mean")
        trainer = Trainer(
            copy.deepcopy(model), TrainerConfig(loss=loss, packing=packing, share_prefixes=share)
        )
        metrics = trainer.forward_backward(samples)
        params = trainer.policy.parameters()
        steps[layout] = (
            metrics,
            {str(i): p.grad.clone() for i, p in enumerate(params) if p.grad is not None},
        )
    _assert_same_step(steps["shared"], steps["padded"])
    shared_tokens, packed_tokens = (steps[layout][0]["forward_tokens"] for layout in ("shared", "packed"))
    if window == 24:
        assert shared_tokens < 0.6 * packed_tokens
    else:
        assert shared_tokens == packed_tokens
