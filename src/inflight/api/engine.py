"""The compute engine of the Tinker-compatible service: LoRA adapters over shared frozen base models, batched
forward_backward and sampling across adapters, AdamW per adapter, and adapter checkpoints.

The HTTP layer decodes wire requests into the dataclasses below, calls the engine from its single worker
loop thread in each model's seq_id order, and encodes the results; the engine knows nothing of HTTP, the
database or futures. Bad input comes back as `inflight.errors.UserError` (in the job's own slot for the
batched calls, raised otherwise); anything else is a server fault.

  forward_backward(jobs) ─┐ grouped by base model: one batched pass per micro-batch, a LoRA plan gives
  sample(jobs)          ──┤ each row its adapter (models/lora.py); losses and grads per job are exact
  optim_step(step)        │ per adapter: torch.optim.AdamW over its own A/B, hyper-parameters per step
  save/load_*             ┘ PEFT-style directories (engine_checkpoint.py)
"""

from __future__ import annotations

import logging
import secrets
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from inflight.api.engine_checkpoint import (
    CheckpointMeta,
    optimizer_state_dict,
    read_adapter_tensors,
    read_meta,
    write_checkpoint,
)
from inflight.api.engine_forward import FbWork, run_forward_backward
from inflight.api.engine_losses import prepare_job
from inflight.api.engine_sampling import PreparedSample, prepare_sample, run_sampling
from inflight.api.engine_types import (
    Datum,
    ForwardBackwardJob,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStep,
    SampledSequence,
    SampleJob,
    SampleOutput,
)
from inflight.errors import UserError
from inflight.models.attention import use_cpu_float32_attention
from inflight.models.loader import load_model, load_tokenizer, native_bfloat16, resolve, resolve_dtype
from inflight.models.lora import LoraRouter, attach_multi_lora
from inflight.models.lora_adapter import LoraAdapter, select_targets
from inflight.types import DtypeName

__all__ = [
    "Datum",
    "ForwardBackwardJob",
    "ForwardBackwardOutput",
    "LoraSpec",
    "OptimStep",
    "SampleJob",
    "SampleOutput",
    "SampledSequence",
    "ServiceEngine",
    "ServiceEngineConfig",
]

log = logging.getLogger(__name__)
ItemT = TypeVar("ItemT")
OutputT = TypeVar("OutputT")


class ServiceEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = "cpu"  # torch device of base models and adapters, e.g. "cuda:0"
    # Base weights; adapters and their optimizer stay float32 (the LoRA matmuls run in the base dtype, as
    # under autocast). "auto": bfloat16 where the device multiplies it natively (a CUDA GPU, a CPU with
    # AVX512-BF16 or AMX), else float32. Tiny model on this CPU (docs/benchmarks.md): bfloat16 trains
    # batches ~1.25x faster than float32; small single requests and sampling run 10-20% slower.
    dtype: DtypeName = "auto"
    # Padded tokens (rows x longest row) per forward/backward pass: bounds activation memory, which has no
    # checkpointing (a 7B model keeps a few MB per token). None: 2048 on CPU, where passes of 4096+ tokens
    # ran ~15% slower per token (caches spill; 256-2048 were alike), and 8192 on an accelerator.
    max_batch_tokens: int | None = Field(default=None, ge=1)
    max_sample_rows: int = Field(default=256, ge=1)  # sequences decoded together
    max_context_tokens: int | None = Field(default=None, ge=2)  # None: the model's max positions
    seed: int | None = None  # generator of unseeded samples; None = nondeterministic


@dataclass
class _Base:
    """One frozen base model with its layers wrapped for multi-LoRA."""

    name: str
    source: str  # the directory or hub id it was loaded from
    model: torch.nn.Module
    config: Any  # the Hugging Face model config
    router: LoraRouter
    shapes: dict[str, tuple[int, int]]  # LoRA-able module -> (in, out)
    tokenizer: Any
    vocab_size: int
    max_context: int
    eos_ids: tuple[int, ...]


@dataclass
class _Trained:
    base_model: str
    spec: LoraSpec
    adapter: LoraAdapter
    optimizer: torch.optim.AdamW
    steps: int = 0  # optimizer steps applied


@dataclass
class _Frozen:
    """Sampler weights: a snapshot or a loaded sampler checkpoint, never trained."""

    base_model: str
    spec: LoraSpec
    adapter: LoraAdapter


class ServiceEngine:
    """Not thread-safe: one thread (the service's worker loop) calls it."""

    def __init__(
        self, base_models: dict[str, str], *, max_rank: int = 64, config: ServiceEngineConfig | None = None
    ) -> None:
        if not base_models:
            raise UserError("the service needs at least one base model (name -> model directory or hub id)")
        self.config = config or ServiceEngineConfig()
        self.max_rank = max_rank
        self._device = torch.device(self.config.device)
        self._dtype = resolve_dtype(self.config.dtype, self._device)
        if self._dtype == torch.bfloat16 and not native_bfloat16(self._device):
            log.warning(
                "%s has no native bfloat16 matmuls: bfloat16 weights run slower than float32 here",
                self._device,
            )
        self._bases = {name: self._load_base(name, source) for name, source in base_models.items()}
        self._trained: dict[str, _Trained] = {}
        self._frozen: dict[str, _Frozen] = {}
        seed = secrets.randbits(63) if self.config.seed is None else self.config.seed
        self._generator = torch.Generator().manual_seed(seed)
        self._tokenizer_tmp: tempfile.TemporaryDirectory | None = None
        # Batched passes that raised (each failed all its jobs with a server error), for the metrics.
        self.counters: dict[str, int] = {"failed_batches": 0, "batches_split": 0}

    @property
    def max_batch_tokens(self) -> int:
        if self.config.max_batch_tokens is not None:
            return self.config.max_batch_tokens
        return 2048 if self._device.type == "cpu" else 8192

    # ---- base models -------------------------------------------------------------------------------

    def base_model_names(self) -> list[str]:
        return list(self._bases)

    def tokenizer_dir(self, base_model: str) -> str:
        """A local directory AutoTokenizer loads offline: the model's own, or a copy for a hub id."""
        base = self._base(base_model)
        if Path(base.source).is_dir():
            return str(Path(base.source).resolve())
        if self._tokenizer_tmp is None:
            self._tokenizer_tmp = tempfile.TemporaryDirectory(prefix="inflight-tokenizers-")
        out = Path(self._tokenizer_tmp.name) / base_model
        if not out.is_dir():
            base.tokenizer.save_pretrained(out)
        return str(out)

    def model_info(self, base_model: str) -> dict[str, Any]:
        base = self._base(base_model)
        config = base.config
        return {
            "vocab_size": base.vocab_size,
            "max_context": base.max_context,
            "arch": (getattr(config, "architectures", None) or [config.model_type])[0],
            "model_type": config.model_type,
            "eos_token_ids": list(base.eos_ids),
            "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "max_lora_rank": self.max_rank,
            "source": base.source,
            "dtype": str(self._dtype).removeprefix("torch."),
        }

    # ---- adapters ----------------------------------------------------------------------------------

    def create_adapter(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        if model_id in self._trained:
            raise UserError(f"model {model_id!r} already exists")
        self._trained[model_id] = self._new_trained(base_model, lora)

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self._trained

    def delete_adapter(self, model_id: str) -> None:
        """Drop the adapter and its optimizer state (idempotent). Its sampler snapshots stay usable."""
        self._trained.pop(model_id, None)

    def adapter_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the adapter's A/B under PEFT names (for inspection and tests)."""
        return self._get_trained(model_id).adapter.state_dict()

    def adapter_gradients(self, model_id: str) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the accumulated gradients under PEFT names (zero after optim_step)."""
        adapter = self._get_trained(model_id).adapter
        return {
            key: (t.grad if t.grad is not None else torch.zeros_like(t)).detach().cpu().clone()
            for key, t in adapter.named_parameters()
        }

    # ---- training ----------------------------------------------------------------------------------

    def forward_backward(self, jobs: list[ForwardBackwardJob]) -> list[ForwardBackwardOutput | Exception]:
        """One batched forward/backward per base model across all jobs, whatever adapter each uses.

        A job's bad input comes back as a UserError in its own slot; the other jobs still run. Gradients
        accumulate (sum) into each adapter until its optim_step; `backward=False` touches none.
        """
        results: list[ForwardBackwardOutput | Exception | None] = [None] * len(jobs)
        groups: dict[str, list[tuple[int, FbWork, LoraAdapter]]] = defaultdict(list)
        for i, job in enumerate(jobs):
            try:
                trained = self._get_trained(job.model_id)
                base = self._bases[trained.base_model]
                prepared = prepare_job(job, base.vocab_size, base.max_context)
            except UserError as exc:
                results[i] = UserError(f"forward_backward for model {job.model_id!r}: {exc}")
                continue
            groups[trained.base_model].append((i, FbWork(prepared, slot=0), trained.adapter))
        for base_name, items in groups.items():
            for (i, _, _), output in zip(items, self._forward_backward_group(base_name, items), strict=True):
                results[i] = output
        return _filled(results)

    def _forward_backward_group(
        self, base_name: str, items: Sequence[tuple[int, FbWork, LoraAdapter]]
    ) -> Sequence[ForwardBackwardOutput | Exception]:
        """One batched pass; if it fails, the gradients it added are taken back and each job runs alone,
        so a fault fails only the job that causes it. A lone job that fails keeps the gradients of the
        micro-batches that ran before the fault: its client sees a server error and decides (Tinker's
        clients usually retry the whole step)."""
        # What the adapters' gradients held before this pass, to take a failed pass's share back. A copy is
        # adapter-sized, small next to the pass's activations.
        saved = [
            (t, t.grad.clone())
            for adapter in {id(adapter): adapter for _, _, adapter in items}.values()
            for t in adapter.parameters()
            if t.grad is not None and len(items) > 1
        ]

        def run(batch: Sequence[tuple[int, FbWork, LoraAdapter]]) -> Sequence[ForwardBackwardOutput]:
            base = self._bases[base_name]
            slots = _assign_slots([(work, adapter) for _, work, adapter in batch])
            work = [work for _, work, _ in batch]
            return run_forward_backward(
                base.model, base.router, slots, work, self.max_batch_tokens, self._device
            )

        def restore() -> None:
            for t, grad in saved:
                t.grad = grad

        return self._isolating_faults("forward_backward", base_name, items, run, restore)

    def _isolating_faults(
        self,
        what: str,
        base_name: str,
        items: Sequence[ItemT],
        run: Callable[[Sequence[ItemT]], Sequence[OutputT]],
        before_retry: Callable[[], None] = lambda: None,
    ) -> Sequence[OutputT | Exception]:
        """`run(items)`; if that raises, `before_retry()` and then `run` on each item alone, so a fault of the
        batched call fails only the items that cause it, not their neighbours (nor the engine)."""
        try:
            return run(items)
        except Exception as exc:  # fault-tolerance boundary: counted, logged, and the item's own result
            self.counters["failed_batches"] += 1
            if len(items) == 1:
                log.exception("%s failed on %s", what, base_name)
                return [exc]
            log.warning(
                "%s of %d jobs on %s failed (%s); running them one by one", what, len(items), base_name, exc
            )
            before_retry()
            self.counters["batches_split"] += 1
            return [out for item in items for out in self._isolating_faults(what, base_name, [item], run)]

    def optim_step(self, step: OptimStep) -> dict[str, float]:
        """AdamW exactly like torch.optim.AdamW with this step's hyper-parameters (after clipping the global
        gradient norm when grad_clip_norm > 0), then zero the gradients."""
        trained = self._get_trained(step.model_id)
        _check_optim_step(step)
        for group in trained.optimizer.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        params = trained.adapter.parameters()
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if step.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, step.grad_clip_norm, grad_norm)
        trained.optimizer.step()
        trained.adapter.zero_grad_buffers()
        trained.steps += 1
        return {
            "grad_norm:mean": float(grad_norm),
            "learning_rate:mean": step.learning_rate,
            "optimizer_step:max": float(trained.steps),
        }

    # ---- sampling ----------------------------------------------------------------------------------

    def sample(self, jobs: list[SampleJob]) -> list[SampleOutput | Exception]:
        """Sample every job, batched per base model across jobs and adapters; bad jobs get a UserError."""
        results: list[SampleOutput | Exception | None] = [None] * len(jobs)
        groups: dict[str, list[tuple[int, PreparedSample, LoraAdapter | None]]] = defaultdict(list)
        for i, job in enumerate(jobs):
            try:
                base = self._base(job.base_model)
                adapter = self._sampling_adapter(job)
                prepared = prepare_sample(job, base.vocab_size, base.max_context, base.eos_ids)
            except UserError as exc:
                results[i] = exc
                continue
            groups[job.base_model].append((i, prepared, adapter))
        for base_name, items in groups.items():
            for (i, _, _), output in zip(items, self._sample_group(base_name, items), strict=True):
                results[i] = output
        return _filled(results)

    def _sample_group(
        self, base_name: str, items: Sequence[tuple[int, PreparedSample, LoraAdapter | None]]
    ) -> Sequence[SampleOutput | Exception]:
        """One batched generation; if it fails, each job runs alone, so a fault fails only the job that
        causes it (seeded jobs give the same tokens alone as batched)."""

        def run(batch: Sequence[tuple[int, PreparedSample, LoraAdapter | None]]) -> Sequence[SampleOutput]:
            base = self._bases[base_name]
            return run_sampling(
                base.model,
                base.router,
                _assign_slots([(prepared, adapter) for _, prepared, adapter in batch]),
                [prepared for _, prepared, _ in batch],
                base.tokenizer,
                self._generator,
                self.config.max_sample_rows,
                self._device,
            )

        return self._isolating_faults("sample", base_name, items, run)

    # ---- checkpoints -------------------------------------------------------------------------------

    def save_state(self, model_id: str, path: Path, include_optimizer: bool = True) -> int:
        """Adapter (+ AdamW moments) to a PEFT-style directory, atomically; returns bytes written."""
        trained = self._get_trained(model_id)
        meta = CheckpointMeta("state", trained.base_model, trained.spec, include_optimizer, trained.steps)
        optimizer = trained.optimizer if include_optimizer else None
        return write_checkpoint(
            path, trained.adapter, meta, self._bases[trained.base_model].source, optimizer
        )

    def save_sampler_weights(self, model_id: str, path: Path) -> int:
        trained = self._get_trained(model_id)
        meta = CheckpointMeta("sampler", trained.base_model, trained.spec, False, trained.steps)
        return write_checkpoint(path, trained.adapter, meta, self._bases[trained.base_model].source, None)

    def load_state(self, model_id: str, path: Path, load_optimizer: bool) -> None:
        """Replace the adapter's weights (and AdamW state, or a fresh one) from a checkpoint; gradients are
        reset. Creates the adapter when `model_id` does not exist yet (create-via-load)."""
        meta = read_meta(path)
        if load_optimizer and not meta.has_optimizer:
            raise UserError(
                f"checkpoint {str(path)!r} holds no optimizer state ({meta.kind} checkpoint saved without "
                "it); load the weights only"
            )
        existing = self._trained.get(model_id)
        if existing is not None and (existing.base_model, _shape(existing.spec)) != (
            meta.base_model,
            _shape(meta.lora),
        ):
            raise UserError(
                f"checkpoint {str(path)!r} is a {meta.lora} adapter of {meta.base_model!r}, but model "
                f"{model_id!r} is a {existing.spec} adapter of {existing.base_model!r}"
            )
        trained = self._new_trained(meta.base_model, existing.spec if existing else meta.lora)
        _load_tensors(trained.adapter, path)
        if load_optimizer:
            trained.optimizer.load_state_dict(optimizer_state_dict(path, trained.adapter, trained.optimizer))
            trained.steps = meta.optimizer_steps
        self._trained[model_id] = trained  # only now: a failed load leaves the old adapter as it was

    def load_sampler_weights(self, key: str, path: Path) -> None:
        """Register a checkpoint's adapter (frozen) under `key`, usable as SampleJob.weights."""
        meta = read_meta(path)
        adapter = self._new_trained(meta.base_model, meta.lora).adapter
        _load_tensors(adapter, path)
        self._frozen[key] = _Frozen(meta.base_model, meta.lora, adapter.frozen_copy())

    def snapshot_sampler_weights(self, model_id: str, key: str) -> None:
        """Ephemeral save_weights_for_sampler: freeze the adapter's current weights under `key` (no disk)."""
        trained = self._get_trained(model_id)
        self._frozen[key] = _Frozen(trained.base_model, trained.spec, trained.adapter.frozen_copy())

    def delete_sampler_weights(self, key: str) -> None:
        """Forget sampler weights registered under `key` (idempotent); frees their memory."""
        self._frozen.pop(key, None)

    # ---- internals ---------------------------------------------------------------------------------

    def _load_base(self, name: str, source: str) -> _Base:
        hf_model = load_model(source, dtype=self._dtype)
        config = hf_model.config
        model: torch.nn.Module = hf_model
        model.to(self._device).eval()
        if self._dtype != torch.float32:
            use_cpu_float32_attention(hf_model)  # no-op off CPU
        log.info("base model %r from %s: %s weights on %s", name, source, self._dtype, self._device)
        router, shapes = attach_multi_lora(model)
        max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        if self.config.max_context_tokens is not None:
            max_context = min(max_context, self.config.max_context_tokens)
        tokenizer = load_tokenizer(source)
        eos: set[int] = set()
        generation = hf_model.generation_config
        for value in (
            generation.eos_token_id if generation else None,
            config.eos_token_id,
            tokenizer.eos_token_id,
        ):
            if value is not None:
                eos.update([value] if isinstance(value, int) else value)
        return _Base(
            name=name,
            source=resolve(source),
            model=model,
            config=config,
            router=router,
            shapes=shapes,
            tokenizer=tokenizer,
            vocab_size=int(config.vocab_size),
            max_context=max_context,
            eos_ids=tuple(sorted(eos)),
        )

    def _base(self, name: str) -> _Base:
        if name not in self._bases:
            raise UserError(f"unknown base model {name!r}; this server has: {', '.join(self._bases)}")
        return self._bases[name]

    def _get_trained(self, model_id: str) -> _Trained:
        if model_id not in self._trained:
            raise UserError(f"unknown model {model_id!r}: create it (or load a checkpoint into it) first")
        return self._trained[model_id]

    def _new_trained(self, base_model: str, spec: LoraSpec) -> _Trained:
        base = self._base(base_model)
        if not 1 <= spec.rank <= self.max_rank:
            raise UserError(f"LoRA rank must be between 1 and {self.max_rank}, got {spec.rank}")
        shapes = select_targets(base.shapes, spec.train_attn, spec.train_mlp, spec.train_unembed)
        if not shapes:
            raise UserError("a LoRA adapter must train something: set train_attn, train_mlp or train_unembed")
        adapter = LoraAdapter.create(shapes, spec.rank, spec.seed, self._device)
        adapter.zero_grad_buffers()
        # lr etc. are placeholders: every optim_step sets its own hyper-parameters.
        optimizer = torch.optim.AdamW(adapter.parameters(), lr=0.0)
        return _Trained(base_model=base_model, spec=spec, adapter=adapter, optimizer=optimizer)

    def _sampling_adapter(self, job: SampleJob) -> LoraAdapter | None:
        if job.weights is None:
            return None
        found: _Frozen | _Trained | None = self._frozen.get(job.weights) or self._trained.get(job.weights)
        if found is None:
            raise UserError(f"unknown sampling weights {job.weights!r} (no model or sampler checkpoint)")
        if found.base_model != job.base_model:
            raise UserError(
                f"sampling weights {job.weights!r} belong to base model {found.base_model!r}, "
                f"not {job.base_model!r}"
            )
        return found.adapter


def _shape(spec: LoraSpec) -> tuple[int, bool, bool, bool]:
    """What makes two adapters' tensors interchangeable (the init seed does not)."""
    return spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed


def _filled(results: Sequence[Any]) -> list[Any]:
    if any(r is None for r in results):
        raise RuntimeError("engine bug: a job got no result")
    return list(results)


def _assign_slots(items: Sequence[tuple[Any, LoraAdapter | None]]) -> list[LoraAdapter | None]:
    """Give each distinct adapter one slot (in order of first use) and set every item's `.slot`."""
    slots: list[LoraAdapter | None] = []
    index: dict[int, int] = {}
    for item, adapter in items:
        key = id(adapter)
        if key not in index:
            index[key] = len(slots)
            slots.append(adapter)
        item.slot = index[key]
    return slots


def _load_tensors(adapter: LoraAdapter, path: Path) -> None:
    try:
        adapter.load_state_dict(read_adapter_tensors(path))
    except ValueError as exc:
        raise UserError(f"checkpoint {str(path)!r}: {exc}") from exc


def _check_optim_step(step: OptimStep) -> None:
    checks = [
        (step.learning_rate >= 0, "learning_rate must be >= 0"),
        (0 <= step.beta1 < 1 and 0 <= step.beta2 < 1, "beta1 and beta2 must lie in [0, 1)"),
        (step.eps >= 0, "eps must be >= 0"),
        (step.weight_decay >= 0, "weight_decay must be >= 0"),
        (step.grad_clip_norm >= 0, "grad_clip_norm must be >= 0 (0 = no clipping)"),
    ]
    problems = [message for ok, message in checks if not ok]
    values = (step.learning_rate, step.beta1, step.beta2, step.eps, step.weight_decay, step.grad_clip_norm)
    if any(v != v or v in (float("inf"), float("-inf")) for v in values):
        problems.append("hyper-parameters must be finite")
    if problems:
        raise UserError(f"optim_step for model {step.model_id!r}: {'; '.join(problems)}")
