"""The pipeline's trainer: micro-batching by samples and padded tokens, gradient accumulation, the RL loss
with its regularisers, the device and autocast, and the policy version. It never sees rewards, only
advantages. What trains (the full model or one LoRA adapter over a frozen base) is the policy's business
(`policy.py`, `lora_policy.py`); run checkpoints are `checkpoint.py`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inflight.errors import UserError
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
from inflight.models.device import resolve_device
from inflight.models.loader import native_bfloat16
from inflight.trainer import checkpoint as checkpoints
from inflight.trainer.batch_layout import (
    MicroBatch,
    packing_is_exact,
    shared_prefixes_are_exact,
    sliding_window,
)
from inflight.trainer.config import TrainerConfig, lr_at
from inflight.trainer.last_layer import last_layer_at, trimmable_last_layer
from inflight.trainer.lora_policy import LoraPolicy
from inflight.trainer.micro_batches import group_by_total_tokens, lexicographic_order, pack_by_tokens
from inflight.trainer.policy import FullPolicy, Policy
from inflight.trainer.types import LoraSpec, OptimStep
from inflight.types import AdapterUpdate, TrainSample


@dataclass(frozen=True)
class StepCounts:
    """A step's size and loss denominators over the WHOLE step: every micro-batch and, data-parallel, every
    rank. The reductions divide by them, so how a step is split changes only rounding."""

    num_tokens: float  # the trained tokens' loss weights, summed (sum of loss_mask[1:])
    num_sequences: float  # samples with at least one trained token
    num_samples: float

    @classmethod
    def of(cls, samples: Sequence[TrainSample]) -> StepCounts:
        return cls(
            num_tokens=float(sum(sum(s.loss_mask[1:]) for s in samples)),
            num_sequences=float(sum(1 for s in samples if any(s.loss_mask[1:]))),
            num_samples=float(len(samples)),
        )


@dataclass
class PartialMetrics:
    """What the micro-batches of (part of) a step accumulate before its metrics are formed: token-weighted
    sums (divided by the step's num_tokens at the end; "loss" is already normalised), extrema, and the
    trained tokens' log ratios (the step's quantiles and ESS need them all). Data-parallel ranks merge
    theirs in rank order."""

    sums: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    extrema: dict[str, float] = field(default_factory=dict)  # *_min keys keep the least, others the most
    log_ratios: list[torch.Tensor] = field(default_factory=list)  # [N] lp - q of each micro-batch
    forward_tokens: int = 0  # tokens the forward passes computed (a shared prefix once)

    def add_extremum(self, key: str, value: float) -> None:
        old = self.extrema.get(key, value)
        self.extrema[key] = min(old, value) if key.endswith("_min") else max(old, value)

    def merge(self, other: PartialMetrics) -> None:
        for key, value in other.sums.items():
            self.sums[key] += value
        for key, value in other.extrema.items():
            self.add_extremum(key, value)
        self.log_ratios.extend(other.log_ratios)
        self.forward_tokens += other.forward_tokens


def through_last_trained(sample: TrainSample) -> TrainSample:
    """The sample cut after its last trained token. What follows (in RL, typically the environment's last
    message: a third of a BlackJack episode) cannot change the logits at any trained position under causal
    attention, so the forward and backward passes need not see it. A sample with nothing trained is kept."""
    last = next((i for i in range(len(sample.loss_mask) - 1, 0, -1) if sample.loss_mask[i]), None)
    if last is None or last == len(sample.token_ids) - 1:
        return sample
    end = last + 1
    return TrainSample(
        token_ids=sample.token_ids[:end],
        loss_mask=sample.loss_mask[:end],
        behaviour_logprobs=sample.behaviour_logprobs[:end],
        advantages=sample.advantages[:end],
        versions=sample.versions[:end],
    )


class Trainer:
    """Policy model + AdamW. `version` counts optimizer steps applied (the policy version contract).

    `trainer.lora_rank > 0` trains one LoRA adapter over the frozen `model` (whose layers are wrapped in
    place: the trainer owns the model), else every parameter. `model` moves to `trainer.device`.
    """

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, pad_id: int = 0) -> None:
        self.config = config
        self.pad_id = pad_id
        self.version = 0
        lr_at(config, 0)  # a schedule that cannot run fails here, not at the first step
        self.device = resolve_device(config.device, "trainer.device")
        self._bf16 = config.autocast_bf16 is True or (
            config.autocast_bf16 == "auto" and native_bfloat16(self.device)
        )
        model.to(self.device)
        self.packing = config.packing and packing_is_exact(model, self.device)
        self.share_prefixes = (
            self.packing and config.share_prefixes and shared_prefixes_are_exact(model, self.device)
        )
        # Shared prefixes only where every sequence fits in the model's sliding window (`sliding_window`).
        self._window = sliding_window(getattr(model, "config", None))
        if config.gradient_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise UserError(
                    f"{type(model).__name__} does not support gradient checkpointing: "
                    "set trainer.gradient_checkpointing=false"
                )
            # Non-reentrant: works with a frozen base (no input needs a gradient) and with the LoRA router.
            # transformers 5 renamed it (the old name warns); older releases have only the old one.
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(  # type: ignore[operator]
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.policy: Policy
        if config.lora_rank:
            spec = LoraSpec(
                rank=config.lora_rank,
                seed=config.lora_seed,
                alpha=config.lora_alpha,
                target_modules=list(config.lora_target_modules),
            )
            self.policy = LoraPolicy(model, spec, self.device)
        else:
            self.policy = FullPolicy(model, keep_reference=config.loss.kl_coef > 0)
        # Gradient checkpointing re-runs each layer in the backward pass, outside the trim's block.
        self._trim = config.trim_last_layer and not config.gradient_checkpointing

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.policy.optimizer

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen copy a full-parameter KL penalty compares with (LoRA's reference is the base: None)."""
        return self.policy.ref_model if isinstance(self.policy, FullPolicy) else None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _shares_prefixes(self, group: Sequence[TrainSample]) -> bool:
        """Whether this micro-batch lays its samples out with shared prefixes: where the model can, and
        every sequence fits in its sliding window, if it has one (`sliding_window`)."""
        if not self.share_prefixes or self._window is None:
            return self.share_prefixes
        return max(len(s.token_ids) - 1 for s in group) <= self._window

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """At most micro_batch_size samples and micro_batch_tokens tokens each (packed: their sum; padded:
        rows x longest row, similar lengths together)."""
        lengths = [len(s.token_ids) - 1 for s in samples]
        cfg = self.config
        if self.packing:
            # Sharing prefixes: neighbours in token order, so that the samples of one prompt meet.
            order = lexicographic_order([s.token_ids for s in samples]) if self.share_prefixes else None
            groups = group_by_total_tokens(lengths, cfg.micro_batch_tokens, cfg.micro_batch_size, order)
        else:
            groups = pack_by_tokens(lengths, cfg.micro_batch_tokens, cfg.micro_batch_size)
        return [[samples[i] for i in group] for group in groups]

    def _trained_logits(
        self,
        model: torch.nn.Module,
        mb: MicroBatch,
        where: tuple,
        routing: Callable[[int], contextlib.AbstractContextManager[None]],
    ) -> torch.Tensor:
        """Logits [N, V] at `where`, the N positions with a nonzero loss weight (mb.mask.nonzero()). The
        caller runs this in `routing(mb.rows)`; the LM head sees the N positions as one row, so it runs in
        `routing(1)`.

        RL samples are mostly prompt and environment tokens; running the LM head, log-softmax and
        entropy only where the loss looks saves most of their cost.
        """
        decoder, head = model.get_decoder(), model.get_output_embeddings()  # type: ignore[operator]
        with self._autocast():
            if decoder is None or head is None:  # not a decoder + LM head model: full logits, then select
                return mb.select(model(**mb.forward_inputs()).logits, where).float()
            layer = self._trimmed_layer(model)
            trim: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if layer is not None:
                trim = last_layer_at(layer, mb.flat_positions(where))
            with trim:
                hidden = decoder(**mb.forward_inputs()).last_hidden_state
            with routing(1):  # [1, N, H]
                return head(mb.select(hidden, where)[None])[0].float()

    def _trimmed_layer(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """`model`'s last decoder layer when it runs only where the loss looks (`trainer/last_layer.py`):
        full-parameter training alone (LoRA routes adapters per row; a sharded policy's layers are FSDP's)."""
        if not self._trim or type(self.policy) is not FullPolicy:
            return None
        return trimmable_last_layer(model)

    def forward_backward(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Accumulate gradients of the loss over `samples`, in micro-batches. Returns step metrics."""
        counts = StepCounts.of(samples)
        return self._step_metrics(self._accumulate(samples, counts), counts)

    def _accumulate(self, samples: Sequence[TrainSample], counts: StepCounts) -> PartialMetrics:
        """Backward of the loss over `samples` in micro-batches, reduced with `counts`: the whole step's
        denominators, which may cover more samples than these (other ranks'). Returns the metrics' sums."""
        cfg, lcfg = self.config, self.config.loss
        self.model.train()
        loss_fn = LOSSES[lcfg.name]
        params = LossParams(
            clip_low_threshold=lcfg.clip_low_threshold,
            clip_high_threshold=lcfg.clip_high_threshold,
            offpolicy=lcfg.offpolicy.kind,
            offpolicy_ratio_low=lcfg.offpolicy.ratio_low,
            offpolicy_ratio_high=lcfg.offpolicy.ratio_high,
        )
        partial = PartialMetrics()
        sums = partial.sums

        def reduce(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return reduce_loss(
                per_token,
                mask,
                lcfg.reduction,
                constant_normalizer=lcfg.constant_normalizer,
                num_tokens=counts.num_tokens,
                num_sequences=counts.num_sequences,
            )

        # The sums use the step's global denominators, so the grouping does not change the result.
        for group in self._micro_batches([through_last_trained(s) for s in samples]):
            shared = self._shares_prefixes(group)
            cpu_mb = MicroBatch.collate(
                group, self.pad_id, self.version, pack=self.packing, share_prefixes=shared
            )
            partial.forward_tokens += cpu_mb.forward_tokens
            mb_tokens = float(cpu_mb.mask.sum())
            # Found on the CPU, where the batch was built: no wait for the device.
            where_cpu = cpu_mb.mask.nonzero(as_tuple=True)
            if not where_cpu[0].numel():  # nothing trained here (e.g. an episode over before any action)
                continue
            mb = cpu_mb.to(self.device)
            where = (where_cpu[0].to(self.device), where_cpu[1].to(self.device))

            def full(values_N: torch.Tensor, mb: MicroBatch = mb, where: tuple = where) -> torch.Tensor:
                """[N] values at the trained positions -> [B, T] with zeros elsewhere (differentiable)."""
                return torch.zeros_like(mb.mask, dtype=values_N.dtype).index_put(where, values_N)

            # backward() inside the routing: gradient checkpointing re-runs the layers during it.
            with self.policy.routing(mb.rows):
                logits_N = self._trained_logits(self.model, mb, where, self.policy.routing)[None]  # [1, N, V]
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
                entropy_logits = logits_N if full_entropy_grad else logits_N.detach()
                entropy = full(entropy_from_logits(entropy_logits, cfg.temperature)[0])
                if bonus:
                    bonus_entropy = (
                        full(top_k_entropy_from_logits(logits_N, lcfg.entropy_top_k, cfg.temperature)[0])
                        if lcfg.entropy_top_k
                        else entropy
                    )
                    loss = loss - lcfg.entropy_coef * reduce(bonus_entropy * mb.mask, mb.mask)
                    sums["entropy_bonus_term"] += float((bonus_entropy.detach() * mb.mask).sum())
                if lcfg.kl_coef > 0:
                    with torch.no_grad():
                        ref_logits_N = self._reference_logits(mb, where)[None]
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
            if cpu_mb.current.any():
                gap = float((lp.detach() - mb.behaviour_logprobs)[current].abs().max())
                partial.add_extremum("logprob_parity_max_abs", gap)
            sums["logprob_parity_token_frac"] += float((cpu_mb.current & (cpu_mb.mask > 0)).sum())
            partial.log_ratios.append((lp.detach() - mb.behaviour_logprobs)[where])

            sums["loss"] += float(loss.detach())  # reductions already use the step's global denominators
            sums["entropy"] += float((entropy.detach() * mb.mask).sum())
            for key, value in out.metrics.items():
                if key == "num_tokens":
                    continue
                if key.endswith(("_max", "_max_abs", "_min")):
                    partial.add_extremum(key, value)
                else:
                    sums[key] += value * mb_tokens
        return partial

    def _step_metrics(self, partial: PartialMetrics, counts: StepCounts) -> dict[str, float]:
        """The step's metrics from the sums of all its micro-batches (data-parallel: of every rank)."""
        sums = dict(partial.sums)
        metrics = {
            "loss": sums.pop("loss", 0.0),
            "num_tokens": counts.num_tokens,
            "num_samples": counts.num_samples,
            "forward_tokens": float(partial.forward_tokens),
        }
        for key, value in sums.items():
            metrics[key] = value / max(counts.num_tokens, 1.0)
        metrics.update(partial.extrema)
        # ESS and the gap's quantiles over the whole step (neither averages over micro-batches); only
        # the RL losses read behaviour log-probs.
        if partial.log_ratios and self.config.loss.name != "cross_entropy":
            metrics.update(to_floats(step_gap_stats(torch.cat(partial.log_ratios))))
        return metrics

    def _reference_logits(self, mb: MicroBatch, where: tuple) -> torch.Tensor:
        """The reference model's logits [N, V] at `where` (the base under LoRA, else the frozen copy)."""
        with self.policy.reference_routing(mb.rows):
            return self._trained_logits(
                self.policy.reference_model(), mb, where, self.policy.reference_routing
            )

    @torch.no_grad()
    def reference_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """Per sample, [T] log p_ref(token_t | tokens_<t) at the trainer's temperature, 0 at t = 0 (aligned
        with `TrainSample.behaviour_logprobs`), on the trainer's device. The reference is the base model
        under LoRA, else the frozen copy a KL penalty keeps (UserError without one)."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        lengths = [len(s.token_ids) - 1 for s in samples]
        for group in pack_by_tokens(lengths, self.config.micro_batch_tokens, self.config.micro_batch_size):
            mb = MicroBatch.collate([samples[i] for i in group], self.pad_id).to(self.device)
            model = self.policy.reference_model()
            with self.policy.reference_routing(mb.rows), self._autocast():
                logits = model(
                    input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
                ).logits.float()
            lp = token_logprobs(logits, mb.targets, temperature=self.config.temperature)  # [B, T]
            for row, i in enumerate(group):
                out[i] = torch.cat([lp.new_zeros(1), lp[row, : lengths[i]]])
        return [t for t in out if t is not None]

    def optim_step(self) -> dict[str, float]:
        """Clip, step, zero. Advances `version`."""
        cfg = self.config
        lr = lr_at(cfg, self.version)
        step = OptimStep(
            model_id="",
            learning_rate=lr,
            beta1=cfg.adam_beta1,
            beta2=cfg.adam_beta2,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            grad_clip_norm=cfg.max_grad_norm,
        )
        grad_norm = float(self.policy.optim_step(step))
        self.version += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.forward_backward(samples)
        metrics.update(self.optim_step())
        metrics["train_s"] = time.perf_counter() - t0
        metrics["train_tokens_per_s"] = sum(len(s.token_ids) for s in samples) / metrics["train_s"]
        return metrics

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Weights, optimizer and version to `path`, durably (`trainer/checkpoint.py`)."""
        return checkpoints.save_checkpoint(self, path, extra)

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load the newest complete checkpoint at `path`; its metadata, or {} when there is none."""
        return checkpoints.resume_checkpoint(self, path)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current full weights by Hugging Face name, detached (the engine copies what it keeps); under
        LoRA the merged W + (alpha / r) B A."""
        return self.policy.weights()

    def base_weights(self) -> dict[str, torch.Tensor]:
        """Under LoRA the frozen base's weights by Hugging Face name (what an engine that applies the adapter
        itself must hold); for full-parameter training, the weights."""
        if isinstance(self.policy, LoraPolicy):
            return self.policy.adapters.base_weights()
        return self.policy.weights()

    def adapter_update(self) -> AdapterUpdate:
        """The trained LoRA adapter (PEFT names), tagged with this version: what `set_adapter` takes, so a
        weight sync ships only the adapter. UserError for full-parameter training."""
        return self.policy.adapter_update(self.version)
