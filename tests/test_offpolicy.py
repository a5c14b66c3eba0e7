"""The off-policy controls (`losses/offpolicy.py`): values against a naive per-token/per-sequence reference,
gradients through the RL losses, the step's diagnostics, and the config that chooses them.

References: truncated IS (TIS, token and sequence level): Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"; masked IS (MIS, token and sequence) and geometric-mean
sequence masking: Liu, Li et al. 2025, "When Speed Kills Stability" (and verl's rollout correction);
IcePop: the Ling Team's Ring-1T report (2025). ESS: Kish's (sum w)^2 / (N sum w^2); quantiles: numpy's.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.config import RunConfig, apply_overrides
from inflight.errors import UserError
from inflight.losses import (
    LOSSES,
    OFFPOLICY_CONTROLS,
    OFFPOLICY_KINDS,
    LossInputs,
    LossParams,
    offpolicy_thresholds,
    step_gap_stats,
)
from inflight.trainer import LossConfig, OffPolicyConfig, Trainer, TrainerConfig
from inflight.types import TrainSample

# Thresholds that make every control act on the random inputs below (log-ratios ~ N(0, 0.5) per token).
THRESHOLDS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "tis_token": (None, 1.3),
    "tis_seq": (None, 1.5),
    "mis_token": (None, 1.3),
    "mis_seq": (None, 1.5),
    "icepop": (0.7, 1.4),
    "geo_mask": (0.9, 1.1),
}


def random_inputs(seed: int, shape: tuple[int, int] = (6, 9)) -> LossInputs:
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    behaviour = logprobs.detach() + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) > 0.3).double()
    mask[0] = 0.0  # a sequence with nothing trained
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    return LossInputs(logprobs, mask, behaviour, advantages)


def naive_token(kind: str, lr: float, seq_log: float, geo: float, low, high) -> tuple[float, bool, bool]:
    """(weight, masked, truncated) of one trained token, from its log-ratio and its sequence's."""
    r = math.exp(lr)
    if kind == "none":
        return r, False, False
    if kind == "tis_token":
        return min(r, high), False, r > high
    if kind == "tis_seq":
        return min(math.exp(seq_log), high), False, seq_log > math.log(high)
    if kind == "mis_token":
        return (0.0, True, False) if r > high else (r, False, False)
    if kind == "mis_seq":
        return (0.0, True, False) if seq_log > math.log(high) else (math.exp(seq_log), False, False)
    if kind == "icepop":
        return (r, False, False) if low <= r <= high else (0.0, True, False)
    assert kind == "geo_mask"
    return (1.0, False, False) if low <= math.exp(geo) <= high else (0.0, True, False)


def naive_correction(kind: str, log_ratio: list[list[float]], active: list[list[bool]], low, high):
    """Per sequence (row), in python floats: (weights, masked, truncated) as nested lists."""
    weights, masked, truncated = [], [], []
    for lr_row, act_row in zip(log_ratio, active, strict=True):
        kept = [lr for lr, a in zip(lr_row, act_row, strict=True) if a]
        seq_log = sum(kept)
        geo = seq_log / len(kept) if kept else 0.0
        rows = [
            naive_token(kind, lr, seq_log, geo, low, high) if a else (1.0, False, False)
            for lr, a in zip(lr_row, act_row, strict=True)
        ]
        weights.append([w for w, _, _ in rows])
        masked.append([m for _, m, _ in rows])
        truncated.append([t for _, _, t in rows])
    return weights, masked, truncated


@pytest.mark.parametrize("kind", OFFPOLICY_KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_control_matches_the_naive_reference(kind: str, seed: int) -> None:
    inputs = random_inputs(seed)
    assert inputs.behaviour_logprobs is not None
    log_ratio = inputs.logprobs.detach() - inputs.behaviour_logprobs
    active = inputs.mask != 0
    low, high = THRESHOLDS[kind]
    out = OFFPOLICY_CONTROLS[kind](log_ratio, active, low, high)
    weights, masked, truncated = naive_correction(kind, log_ratio.tolist(), active.tolist(), low, high)
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float64))
    assert out.masked.tolist() == masked and out.truncated.tolist() == truncated
    assert not out.weights.requires_grad
    if kind in ("mis_token", "mis_seq", "icepop", "geo_mask"):
        assert out.masked.any() and out.masked.sum() < active.sum()  # the thresholds really bite
    if kind in ("tis_token", "tis_seq"):
        assert out.truncated.any()


@pytest.mark.parametrize("kind", ["tis_seq", "mis_seq", "geo_mask"])
def test_sequence_controls_survive_ratios_that_overflow(kind: str) -> None:
    # 400 tokens of log-ratio +2: the sequence ratio is exp(800), inf in float64.
    log_ratio = torch.full((2, 400), 2.0, dtype=torch.float64)
    log_ratio[1] = -2.0
    active = torch.ones_like(log_ratio, dtype=torch.bool)
    low, high = THRESHOLDS[kind]
    out = OFFPOLICY_CONTROLS[kind](log_ratio, active, low, high)
    assert torch.isfinite(out.weights).all()
    assert out.weights[0, 0].item() == pytest.approx(high if kind == "tis_seq" else 0.0)
    assert out.weights[1, 0].item() == pytest.approx(0.0, abs=1e-300)  # exp(-800) underflows, or masked


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
@pytest.mark.parametrize("kind", [k for k in OFFPOLICY_KINDS if k != "none"])
def test_loss_value_and_gradient_are_the_corrected_policy_gradient(name: str, kind: str) -> None:
    """Without proximal log-probs the ratio is 1 in value (anchor = stopgrad(lp)), so every RL loss is
    -w A mask with gradient -w A mask: the control's weight times the on-policy policy gradient."""
    inputs = random_inputs(3)
    assert inputs.behaviour_logprobs is not None and inputs.advantages is not None
    low, high = THRESHOLDS[kind]
    params = LossParams(offpolicy=kind, offpolicy_ratio_low=low, offpolicy_ratio_high=high)  # type: ignore[arg-type]
    active = inputs.mask != 0
    log_ratio = inputs.logprobs.detach() - inputs.behaviour_logprobs
    weights, _, _ = naive_correction(kind, log_ratio.tolist(), active.tolist(), low, high)
    weights_t = torch.tensor(weights, dtype=torch.float64)
    out = LOSSES[name](inputs, params)
    expected = -weights_t * inputs.advantages * inputs.mask
    if name == "cispo":  # -clip(r) * lp * A: the value carries lp, the gradient does not
        torch.testing.assert_close(out.per_token, expected * inputs.logprobs.detach())
    else:
        torch.testing.assert_close(out.per_token, expected)
    (grad,) = torch.autograd.grad(out.per_token.sum(), inputs.logprobs)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("kind", [k for k in OFFPOLICY_KINDS if k != "none"])
def test_gradcheck_with_proximal_logprobs(kind: str) -> None:
    """With proximal log-probs the weights depend on (proximal, q) only, so the loss is a smooth function of
    lp away from the thresholds: finite differences agree with autograd."""
    inputs = random_inputs(4, shape=(3, 4))
    assert inputs.behaviour_logprobs is not None
    proximal = inputs.logprobs.detach() + 0.05
    low, high = THRESHOLDS[kind]
    params = LossParams(offpolicy=kind, offpolicy_ratio_low=low, offpolicy_ratio_high=high)  # type: ignore[arg-type]
    for name in ("importance_sampling", "ppo"):

        def loss(logprobs: torch.Tensor, name: str = name) -> torch.Tensor:
            return LOSSES[name](
                replace(inputs, logprobs=logprobs, proximal_logprobs=proximal), params
            ).per_token

        assert torch.autograd.gradcheck(loss, (inputs.logprobs,))


def test_masked_and_truncated_fractions_are_logged_hand_computed() -> None:
    # ratios 3.0, 0.2, 1.0, 1.0 (the last one not trained): icepop [0.5, 2] masks 2 of 3 trained tokens.
    ratios = torch.tensor([[3.0, 0.2, 1.0, 1.0]], dtype=torch.float64)
    logprobs = torch.full((1, 4), -1.0, dtype=torch.float64)
    inputs = LossInputs(
        logprobs,
        mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64),
        behaviour_logprobs=logprobs - ratios.log(),
        advantages=torch.ones(1, 4, dtype=torch.float64),
    )
    icepop = LOSSES["ppo"](
        inputs, LossParams(offpolicy="icepop", offpolicy_ratio_low=0.5, offpolicy_ratio_high=2.0)
    )
    assert icepop.metrics["offpolicy_masked_frac"] == pytest.approx(2 / 3)
    assert icepop.metrics["offpolicy_truncated_frac"] == 0.0
    assert (icepop.metrics["is_weight_mean"], icepop.metrics["is_weight_max"]) == pytest.approx(
        (4.2 / 3, 3.0)
    )
    tis = LOSSES["ppo"](inputs, LossParams(offpolicy="tis_token", offpolicy_ratio_high=2.0))
    assert tis.metrics["offpolicy_truncated_frac"] == pytest.approx(1 / 3)
    assert tis.metrics["offpolicy_masked_frac"] == 0.0
    default = LOSSES["ppo"](inputs, LossParams())
    assert default.metrics["offpolicy_masked_frac"] == default.metrics["offpolicy_truncated_frac"] == 0.0


def test_step_gap_stats_match_numpy_and_kish() -> None:
    rng = np.random.default_rng(0)
    log_ratio = rng.normal(0.0, 0.3, size=1001)
    stats = {k: float(v) for k, v in step_gap_stats(torch.from_numpy(log_ratio)).items()}
    gap = np.abs(log_ratio)
    for q in (50, 90, 99):
        assert stats[f"logprob_diff_p{q}_abs"] == pytest.approx(np.quantile(gap, q / 100))
    r = np.exp(log_ratio)
    assert stats["ess"] == pytest.approx(r.sum() ** 2 / (len(r) * (r**2).sum()))
    huge = {k: float(v) for k, v in step_gap_stats(torch.tensor([1000.0, 0.0])).items()}
    assert huge["ess"] == pytest.approx(0.5) and math.isfinite(huge["logprob_diff_p99_abs"])
    empty = step_gap_stats(torch.zeros(0))
    assert all(float(v) == 0.0 for v in empty.values())


def test_thresholds_defaults_and_errors() -> None:
    assert offpolicy_thresholds("none") == (None, None)
    assert offpolicy_thresholds("tis_token") == (None, 2.0)
    assert offpolicy_thresholds("icepop") == (0.5, 5.0)
    assert offpolicy_thresholds("icepop", high=3.0) == (0.5, 3.0)
    with pytest.raises(ValueError, match="does not use ratio_low"):
        offpolicy_thresholds("tis_token", low=0.5)
    with pytest.raises(ValueError, match="ratio_high > 0"):
        offpolicy_thresholds("mis_seq", high=0.0)
    with pytest.raises(ValueError, match="0 <= ratio_low <= ratio_high"):
        offpolicy_thresholds("geo_mask", low=1.2, high=1.1)
    with pytest.raises(ValueError, match="unknown off-policy control"):
        offpolicy_thresholds("clip")


def test_config_chooses_the_control_and_bad_thresholds_are_one_line() -> None:
    cfg = apply_overrides(
        RunConfig(), ["trainer.loss.offpolicy.kind=icepop", "trainer.loss.offpolicy.ratio_high=3"]
    )
    assert cfg.trainer.loss.offpolicy == OffPolicyConfig(kind="icepop", ratio_high=3.0)
    assert RunConfig().trainer.loss.offpolicy.kind == "none"  # the default keeps Tinker's losses exactly
    with pytest.raises(UserError, match=r"trainer\.loss\.offpolicy.*does not use ratio_low") as info:
        apply_overrides(
            RunConfig(), ["trainer.loss.offpolicy.kind=tis_seq", "trainer.loss.offpolicy.ratio_low=1"]
        )
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"offpolicy\.kind"):
        apply_overrides(RunConfig(), ["trainer.loss.offpolicy.kind=clip"])


def make_samples(n: int, vocab: int, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(6, 16)
        prompt = rng.randint(2, length - 3)
        mask = [0.0] * prompt + [1.0] * (length - prompt)
        samples.append(
            TrainSample(
                token_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behaviour_logprobs=[-rng.uniform(4.0, 11.0) * m for m in mask],
                advantages=[rng.uniform(-1, 1) * m for m in mask],
                versions=[0 if m else -1 for m in mask],
            )
        )
    return samples


def test_trainer_logs_the_diagnostics_exactly_over_the_step(tiny_model_dir: Path) -> None:
    from inflight.models import load_model

    samples = make_samples(10, vocab=2048)
    metrics = {}
    for micro in (3, 10):  # the step's ESS and quantiles must not depend on micro-batching
        torch.manual_seed(0)
        loss = LossConfig(offpolicy=OffPolicyConfig(kind="icepop", ratio_low=0.5, ratio_high=2.0))
        trainer = Trainer(load_model(tiny_model_dir), TrainerConfig(micro_batch_size=micro, loss=loss))
        metrics[micro] = trainer.forward_backward(samples)
    for key in ("ess", "logprob_diff_p50_abs", "logprob_diff_p90_abs", "logprob_diff_p99_abs"):
        assert metrics[3][key] == pytest.approx(metrics[10][key], rel=1e-6), key
    m = metrics[10]
    assert 0 < m["ess"] <= 1
    assert m["logprob_diff_p50_abs"] <= m["logprob_diff_p90_abs"] <= m["logprob_diff_p99_abs"]
    assert m["logprob_diff_p99_abs"] <= m["logprob_diff_max_abs"]
    # Random behaviour log-probs far from the model's: icepop masks some tokens, and says how many.
    assert 0 < m["offpolicy_masked_frac"] < 1
    assert m["offpolicy_masked_frac"] == pytest.approx(metrics[3]["offpolicy_masked_frac"])
    for key in ("is_weight_mean", "is_weight_max", "offpolicy_truncated_frac"):
        assert key in m
