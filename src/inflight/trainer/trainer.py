"""The trainer owns the policy parameters and the optimizer: micro-batching, gradient accumulation,
the policy loss with its regularisers, and checkpoints. It never sees rewards, only advantages.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.losses import (
    KL_ESTIMATORS,
    LOSSES,
    LossInputs,
    LossParams,
    entropy_from_logits,
    kl_ref_to_policy_exact,
    reduce_loss,
    step_gap_stats,
    token_logprobs,
    top_k_entropy_from_logits,
)
from inflight.losses.importance import to_floats
from inflight.trainer.config import TrainerConfig, lr_at
from inflight.types import TrainSample


@dataclass
class MicroBatch:
    """Right-padded tensors for one forward/backward. Position t holds the target token t+1 of a sample."""

    input_ids: torch.Tensor  # [B, T] tokens 0..T-1 of each sample (padded)
    attention_mask: torch.Tensor  # [B, T] 1 for real tokens
    targets: torch.Tensor  # [B, T] token t+1 (0 where padded)
    mask: torch.Tensor  # [B, T] loss weight of target t+1
    behaviour_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T]
    # [B, T] bool: target t+1 was sampled by weights of version `current_version` on a prefix those same
    # weights computed (its whole reply was); there, engine and trainer logprobs must agree exactly.
    current: torch.Tensor

    @classmethod
    def collate(
        cls, samples: Sequence[TrainSample], pad_id: int = 0, current_version: int | None = None
    ) -> MicroBatch:
        width = max(len(s.token_ids) for s in samples) - 1
        if width < 1:
            raise ValueError("every TrainSample needs at least 2 tokens (a context and a target)")

        def pad(rows: Sequence[Sequence[float]], dtype: torch.dtype, value: float = 0) -> torch.Tensor:
            out = torch.full((len(rows), width), value, dtype=dtype)
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=dtype)
            return out

        return cls(
            input_ids=pad([s.token_ids[:-1] for s in samples], torch.long, pad_id),
            attention_mask=pad([[1] * (len(s.token_ids) - 1) for s in samples], torch.long),
            targets=pad([s.token_ids[1:] for s in samples], torch.long),
            mask=pad([s.loss_mask[1:] for s in samples], torch.float32),
            behaviour_logprobs=pad([s.behaviour_logprobs[1:] for s in samples], torch.float32),
            advantages=pad([s.advantages[1:] for s in samples], torch.float32),
            current=pad(
                [sampled_by(s.versions, s.loss_mask, current_version)[1:] for s in samples], torch.bool
            ),
        )


def sampled_by(versions: Sequence[int], loss_mask: Sequence[float], version: int | None) -> list[bool]:
    """Per token: trained, and its reply (a run of trained tokens) was sampled by `version` throughout.

    A reply starts with a prefill and its first token in one engine step, so an update between its
    tokens is the only way its KV prefix can come from other weights (`kv_policy=keep`); a reply all of
    one version has none. Multi-turn prompts are re-prefilled every turn.
    """
    out = [False] * len(versions)
    start = 0
    while start < len(versions):
        if not loss_mask[start]:
            start += 1
            continue
        end = start
        while end < len(versions) and loss_mask[end]:
            end += 1
        if version is not None and all(v == version for v in versions[start:end]):
            out[start:end] = [True] * (end - start)
        start = end
    return out


class Trainer:
    """Policy model + AdamW. `version` counts optimizer steps applied (the policy version contract)."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, pad_id: int = 0) -> None:
        self.model = model
        self.config = config
        self.pad_id = pad_id
        self.version = 0
        lr_at(config, 0)  # a schedule that cannot run fails here, not at the first step
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        # The reference is a frozen snapshot of the weights at construction (after any warm-up the
        # caller did before building the trainer); only kept when a KL penalty needs it.
        self.ref_model: torch.nn.Module | None = None
        if config.loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.autocast_bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _trained_logits(self, model: torch.nn.Module, mb: MicroBatch, where: tuple) -> torch.Tensor:
        """Logits [N, V] at `where`, the N positions with a nonzero loss weight (mb.mask.nonzero()).

        RL samples are mostly prompt and environment tokens; running the LM head, log-softmax and
        entropy only where the loss looks saves most of their cost.
        """
        rows, cols = where
        decoder, head = model.get_decoder(), model.get_output_embeddings()  # type: ignore[operator]
        with self._autocast():
            if decoder is None or head is None:  # not a decoder + LM head model: full logits, then select
                return (
                    model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[rows, cols].float()
                )
            hidden = decoder(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
            return head(hidden[rows, cols]).float()

    def forward_backward(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Accumulate gradients of the loss over `samples`, in micro-batches. Returns step metrics."""
        cfg, lcfg = self.config, self.config.loss
        self.model.train()
        num_tokens = float(sum(sum(s.loss_mask[1:]) for s in samples))
        num_seqs = float(sum(1 for s in samples if any(s.loss_mask[1:])))
        loss_fn = LOSSES[lcfg.name]
        params = LossParams(
            clip_low_threshold=lcfg.clip_low_threshold,
            clip_high_threshold=lcfg.clip_high_threshold,
            offpolicy=lcfg.offpolicy.kind,
            offpolicy_ratio_low=lcfg.offpolicy.ratio_low,
            offpolicy_ratio_high=lcfg.offpolicy.ratio_high,
        )
        sums: dict[str, float] = defaultdict(float)  # token-weighted sums of per-micro-batch metrics
        maxima: dict[str, float] = {}
        log_ratios: list[torch.Tensor] = []  # [N] lp - q of each micro-batch's trained tokens

        def reduce(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return reduce_loss(
                per_token,
                mask,
                lcfg.reduction,
                constant_normalizer=lcfg.constant_normalizer,
                num_tokens=num_tokens,
                num_sequences=num_seqs,
            )

        # Similar lengths share a micro-batch (less padding); the sums use global denominators,
        # so the order does not change the result.
        ordered = sorted(samples, key=lambda s: len(s.token_ids))
        for start in range(0, len(ordered), cfg.micro_batch_size):
            mb = MicroBatch.collate(ordered[start : start + cfg.micro_batch_size], self.pad_id, self.version)
            mb_tokens = float(mb.mask.sum())
            where = mb.mask.nonzero(as_tuple=True)
            if not where[0].numel():  # nothing trained here (e.g. an episode over before any action)
                continue

            def full(values_N: torch.Tensor, mb: MicroBatch = mb, where: tuple = where) -> torch.Tensor:
                """[N] values at the trained positions -> [B, T] with zeros elsewhere (differentiable)."""
                return torch.zeros_like(mb.mask, dtype=values_N.dtype).index_put(where, values_N)

            logits_N = self._trained_logits(self.model, mb, where)[None]  # [1, N, V]
            targets_N = mb.targets[where][None]
            lp = full(token_logprobs(logits_N, targets_N, temperature=cfg.temperature)[0])
            out = loss_fn(
                LossInputs(
                    logprobs=lp,
                    mask=mb.mask,
                    behaviour_logprobs=mb.behaviour_logprobs,
                    advantages=mb.advantages,
                ),
                params,
            )
            loss = reduce(out.per_token, mb.mask)
            bonus = lcfg.entropy_coef > 0
            full_entropy_grad = bonus and not lcfg.entropy_top_k
            entropy = full(
                entropy_from_logits(logits_N if full_entropy_grad else logits_N.detach(), cfg.temperature)[0]
            )
            if bonus:
                bonus_entropy = (
                    full(top_k_entropy_from_logits(logits_N, lcfg.entropy_top_k, cfg.temperature)[0])
                    if lcfg.entropy_top_k
                    else entropy
                )
                loss = loss - lcfg.entropy_coef * reduce(bonus_entropy * mb.mask, mb.mask)
                sums["entropy_bonus_term"] += float((bonus_entropy.detach() * mb.mask).sum())
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits_N = self._trained_logits(self.ref_model, mb, where)[None]
                if lcfg.kl_estimator == "exact_ref":
                    kl = full(kl_ref_to_policy_exact(logits_N, ref_logits_N, cfg.temperature)[0])
                else:
                    ref_lp = full(token_logprobs(ref_logits_N, targets_N, cfg.temperature)[0])
                    kl = KL_ESTIMATORS[lcfg.kl_estimator](lp, ref_lp)
                loss = loss + lcfg.kl_coef * reduce(kl * mb.mask, mb.mask)
                sums["kl"] += float((kl.detach() * mb.mask).sum())
            loss.backward()

            # Engine-vs-trainer parity where it must hold exactly: tokens of the trainer's own weights.
            current = mb.current & (mb.mask > 0)
            if current.any():
                gap = float((lp.detach() - mb.behaviour_logprobs)[current].abs().max())
                maxima["logprob_parity_max_abs"] = max(maxima.get("logprob_parity_max_abs", gap), gap)
            sums["logprob_parity_token_frac"] += float(current.sum())
            log_ratios.append((lp.detach() - mb.behaviour_logprobs)[where])

            sums["loss"] += float(loss.detach())  # reductions already use the step's global denominators
            sums["entropy"] += float((entropy.detach() * mb.mask).sum())
            for key, value in out.metrics.items():
                if key == "num_tokens":
                    continue
                if key.endswith(("_max", "_max_abs")):
                    maxima[key] = max(maxima.get(key, value), value)
                elif key.endswith("_min"):
                    maxima[key] = min(maxima.get(key, value), value)
                else:
                    sums[key] += value * mb_tokens
        metrics = {
            "loss": sums.pop("loss", 0.0),
            "num_tokens": num_tokens,
            "num_samples": float(len(samples)),
        }
        for key, value in sums.items():
            metrics[key] = value / max(num_tokens, 1.0)
        metrics.update(maxima)
        # ESS and the gap's quantiles over the whole step (neither averages over micro-batches); only
        # the RL losses read behaviour log-probs.
        if log_ratios and lcfg.name != "cross_entropy":
            metrics.update(to_floats(step_gap_stats(torch.cat(log_ratios))))
        return metrics

    def optim_step(self) -> dict[str, float]:
        """Clip, step, zero. Advances `version`."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = lr_at(self.config, self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.forward_backward(samples)
        metrics.update(self.optim_step())
        metrics["train_s"] = time.perf_counter() - t0
        metrics["train_tokens_per_s"] = sum(len(s.token_ids) for s in samples) / metrics["train_s"]
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights by Hugging Face name, detached (the engine copies what it keeps)."""
        return {name: t.detach() for name, t in self.model.state_dict().items()}
