"""Tinker's loss semantics over the pure losses in `inflight.losses`: validating a forward_backward job's
datums and loss config into tensors, the per-token loss of its rows, and its `name:reduction` metrics.

Losses are plain SUMS over tokens and datums (no normalisation). Knows nothing of models or batching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inflight.errors import UserError
from inflight.losses import LOSSES, LossFn, LossInputs, LossOutputs, LossParams
from inflight.trainer.types import Datum, ForwardBackwardJob

SUPPORTED_LOSSES: tuple[str, ...] = tuple(LOSSES)
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_KNOWN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages")
_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
# Every loss's accepted `loss_fn_config` keys (Tinker's loss pages); any other key is refused by name.
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": _CLIP_KEYS,
    "cispo": _CLIP_KEYS,
    "dro": ("beta",),
    "stable_reinforce": ("kl_coeff",),  # the key the tinker SDK names (ForwardBackwardInput.loss_fn_config)
}
# Penalty coefficients: any finite value >= 0.
_PENALTY_KEYS = ("beta", "kl_coeff")
# Losses whose per-token value and gradient vanish where A = 0, so those tokens may leave the mask
# (see `loss_outputs`); the penalties of dro and stable_reinforce do not vanish there.
_ZERO_AT_ZERO_ADVANTAGE = frozenset({"importance_sampling", "ppo", "cispo"})
# Tinker names the server does not run, with the reason the client is told.
_REFUSED = {
    "gspo": "not implemented on this server",
    "custom": "server-side custom losses (create_custom_loss) are not served; forward_backward_custom works",
}


@dataclass
class PreparedDatum:
    """One datum as tensors, all [T] and aligned: targets[i] is predicted from input_ids[: i + 1]."""

    input_ids: Tensor  # [T] long
    targets: Tensor  # [T] long
    weights: Tensor  # [T] float32, 1 where the client sent none
    behaviour_logprobs: Tensor  # [T] float32 sampler log-probs q (0 for cross_entropy)
    advantages: Tensor  # [T] float32 (0 for cross_entropy)

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class PreparedJob:
    job: ForwardBackwardJob
    loss_fn: LossFn
    params: LossParams
    datums: list[PreparedDatum]

    @property
    def is_rl(self) -> bool:
        return self.job.loss_fn != "cross_entropy"


def prepare_job(job: ForwardBackwardJob, vocab_size: int, max_tokens: int) -> PreparedJob:
    """Validate a job and turn its datums into tensors; every problem is a UserError naming it."""
    params = loss_params(job.loss_fn, job.loss_fn_config)
    if not job.data:
        raise UserError("forward_backward needs at least one datum, got an empty list")
    datums = [
        _prepare_datum(i, datum, job.loss_fn, vocab_size, max_tokens) for i, datum in enumerate(job.data)
    ]
    return PreparedJob(job=job, loss_fn=LOSSES[job.loss_fn], params=params, datums=datums)


def loss_params(loss_fn: str, config: dict[str, float] | None) -> LossParams:
    """The loss's name and `loss_fn_config` checked (UserError naming the loss or key) into LossParams.

    Runs at submission (the route's check) and again in the worker, so a bad config fails its request
    before it queues."""
    if loss_fn in _REFUSED:
        raise UserError(
            f"loss_fn {loss_fn!r} is not supported: {_REFUSED[loss_fn]}; this server supports: "
            f"{', '.join(SUPPORTED_LOSSES)}"
        )
    if loss_fn not in LOSSES:
        raise UserError(f"unknown loss_fn {loss_fn!r}; this server supports: {', '.join(SUPPORTED_LOSSES)}")
    allowed = CONFIG_KEYS[loss_fn]
    config = dict(config or {})
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        hint = f"it accepts {', '.join(allowed)}" if allowed else "it takes no config"
        raise UserError(f"loss_fn_config for {loss_fn!r} has unknown keys {unknown}; {hint}")
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise UserError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    params = LossParams(
        clip_low_threshold=config.get("clip_low_threshold"),
        clip_high_threshold=config.get("clip_high_threshold"),
        beta=config.get("beta"),
        kl_coeff=config.get("kl_coeff"),
    )
    if "clip_low_threshold" in allowed:
        try:
            params.clip_thresholds(loss_fn)
        except ValueError as exc:
            raise UserError(f"loss_fn_config: {exc}") from exc
    for key in _PENALTY_KEYS:
        if config.get(key, 0.0) < 0:
            raise UserError(f"loss_fn_config[{key!r}] must be >= 0 (a penalty), got {config[key]}")
    return params


def _prepare_datum(index: int, datum: Datum, loss_fn: str, vocab_size: int, max_tokens: int) -> PreparedDatum:
    where = f"datum {index}"
    n = len(datum.input_tokens)
    if n == 0:
        raise UserError(f"{where}: model_input has no tokens")
    if n > max_tokens:
        raise UserError(f"{where}: {n} tokens exceed the model's context of {max_tokens}")
    inputs = datum.loss_fn_inputs
    unknown = sorted(set(inputs) - set(_KNOWN_INPUTS))
    if unknown:
        raise UserError(f"{where}: unknown loss_fn_inputs {unknown}; expected some of {list(_KNOWN_INPUTS)}")
    required = ("target_tokens",) if loss_fn == "cross_entropy" else _RL_INPUTS
    missing = [key for key in required if key not in inputs]
    if missing:
        raise UserError(f"{where}: loss {loss_fn!r} needs loss_fn_inputs {missing}")
    for key, values in inputs.items():
        if len(values) != n:
            raise UserError(
                f"{where}: loss_fn_inputs[{key!r}] has {len(values)} values but model_input has {n} tokens "
                "(each input is one value per input token; top-K targets are not supported)"
            )

    def floats(key: str, default: float) -> Tensor:
        if key not in inputs:
            return torch.full((n,), default, dtype=torch.float32)
        values = torch.tensor(inputs[key], dtype=torch.float64)
        bad = (~torch.isfinite(values)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise UserError(f"{where}: loss_fn_inputs[{key!r}][{i}] = {inputs[key][i]} is not finite")
        return values.float()

    weights, advantages = floats("weights", 1.0), floats("advantages", 0.0)
    if loss_fn == "stable_reinforce":
        weights = weights * _sampled_rows(where, datum, advantages)
    return PreparedDatum(
        input_ids=_token_ids(f"{where}: model_input", datum.input_tokens, vocab_size),
        targets=_token_ids(f"{where}: target_tokens", inputs["target_tokens"], vocab_size),
        weights=weights,
        behaviour_logprobs=floats("logprobs", 0.0),
        advantages=advantages,
    )


def _sampled_rows(where: str, datum: Datum, advantages: Tensor) -> Tensor:
    """[T] 1.0 at the rows the datum's provenance attributes to sampled tokens, else 0.0.

    stable_reinforce trains on sampled tokens only: Tinker needs provenance on every datum (tinker-cookbook
    0.6.1 checks it before sending) and "only accepts nonzero advantages on sampled tokens" (its
    rl/train.py). The sequence ids are not looked up: this server's reading of the loss needs nothing the
    sampler recorded, only the datum's logprobs.
    """
    spans = datum.loss_fn_input_spans
    if not spans:
        raise UserError(
            f"{where}: loss 'stable_reinforce' needs provenance: loss_fn_input_spans naming the sampled "
            "sequence behind each target (Datum.with_provenance)"
        )
    sampled = torch.cat([torch.full((span.length,), float(span.sampled)) for span in spans])
    if sampled.numel() != advantages.numel():
        raise UserError(
            f"{where}: loss_fn_input_spans cover {sampled.numel()} rows but target_tokens has "
            f"{advantages.numel()}; the runs must tile it exactly"
        )
    outside = ((advantages != 0) & (sampled == 0)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise UserError(
            f"{where}: loss_fn_inputs['advantages'][{i}] = {float(advantages[i])} is on a prompt row; "
            "stable_reinforce only accepts nonzero advantages on sampled tokens"
        )
    return sampled


def _token_ids(where: str, values: Sequence[int | float], vocab_size: int) -> Tensor:
    ids = torch.tensor(values, dtype=torch.float64)  # JSON may decode ids as floats; they must be integral
    bad = ((ids != ids.round()) | (ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise UserError(f"{where}[{i}] = {values[i]} is not a token id in [0, {vocab_size})")
    return ids.long()


def loss_outputs(job: PreparedJob, logprobs: Tensor, rows: dict[str, Tensor]) -> LossOutputs:
    """The Tinker per-token loss [b,T] (and its statistics) of `job` from learner log-probs [b,T].

    `rows` holds the job's padded "weights", "behaviour_logprobs", "advantages" [b,T] (0 at padding).
    For importance_sampling, ppo and cispo the mask is weights * (A != 0): where A = 0 (the prompt part of
    an RL datum, which the cookbook pads with q = 0) those losses are 0 with gradient 0 anyway, and leaving
    the tokens out keeps the ratio statistics about the tokens the loss uses. dro keeps them: its
    penalty -beta/2 (lp - q)^2 is Tinker's on every token the weights keep. stable_reinforce's weights
    already keep only the sampled rows (`_sampled_rows`), where its KL term acts whatever A is.
    """
    weights = rows["weights"]
    if job.job.loss_fn in _ZERO_AT_ZERO_ADVANTAGE:
        weights = weights * (rows["advantages"] != 0)
    inputs = LossInputs(
        logprobs=logprobs,
        mask=weights,
        behaviour_logprobs=rows["behaviour_logprobs"] if job.is_rl else None,
        advantages=rows["advantages"] if job.is_rl else None,
    )
    return job.loss_fn(inputs, job.params)


def job_metrics(job: PreparedJob, logprobs: Sequence[Tensor], losses: Sequence[Tensor]) -> dict[str, float]:
    """`name:reduction` metrics of a whole job from its datums' detached log-probs and per-token losses [T].

    The loss statistics (ratio, ESS, clip fractions) are recomputed over the job's concatenated tokens,
    so they do not depend on how its datums were split into micro-batches.
    """
    rows = {
        key: torch.cat([getattr(d, key) for d in job.datums])[None]
        for key in ("weights", "behaviour_logprobs", "advantages")
    }
    lp = torch.cat([t.detach().cpu() for t in logprobs])[None]
    with torch.no_grad():
        stats = loss_outputs(job, lp, rows).metrics
    total = float(torch.cat([t.detach().double().cpu() for t in losses]).sum())
    metrics = {"loss:sum": total, "num_datums:sum": float(len(job.datums))}
    for key, value in stats.items():
        metrics[f"{key}:{_reduction(key)}"] = value
    return metrics


def _reduction(key: str) -> str:
    # How the SDK combines a metric across the chunks of one large forward_backward call.
    if key == "num_tokens":
        return "sum"
    if key.endswith(("_max", "_max_abs")):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "mean"
