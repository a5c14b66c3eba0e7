"""The tenants' view of the compute core: base models by name, each tenant model an adapter in the trainer's
adapter set of its base, sampler weights sent to the base's engine, fault isolation per job, and the
service's checkpoint records. No model code of its own: it computes through `trainer/` and `inference/`.

The HTTP layer decodes wire requests into the job types (`job_types.py`), calls this from its single worker
loop thread in each model's seq_id order, and encodes the results; nothing here knows HTTP, the
database or futures. Bad input comes back as `inflight.errors.UserError` (in the job's own slot for the
batched calls, raised otherwise); anything else is a server fault.

  forward_backward(jobs) ─┐ trainer/: one AdapterSet per base model (one batched pass per micro-batch,
  optim_step(step)        │ exact per-job losses and per-adapter AdamW) and its PEFT checkpoint files
  save/load_*             ┘ (trainer/adapter_checkpoint.py)
  sampling_engines()      ─ inference/: one BuiltinEngine per base model (its own copy of the weights, made
                            before the trainer wraps the layers); the worker samples through it
                            (`sampler.py`), on its own thread, with adapters it gets from `sampler_update`
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from inflight.api.job_types import ForwardBackwardJob, ForwardBackwardOutput, LoraSpec, OptimStep
from inflight.api.sampler import SamplingLimits
from inflight.errors import UserError
from inflight.inference.builtin import BuiltinEngine, BuiltinEngineConfig
from inflight.models.attention import use_cpu_float32_attention
from inflight.models.device import resolve_device
from inflight.models.loader import load_model, load_tokenizer, native_bfloat16, resolve_dtype
from inflight.models.paths import resolve
from inflight.trainer.adapter_checkpoint import (
    CheckpointMeta,
    read_adapter_tensors,
    read_meta,
    write_checkpoint,
)
from inflight.trainer.adapters import AdapterSet, TrainedAdapter
from inflight.trainer.tinker_losses import PreparedJob, prepare_job
from inflight.types import AdapterUpdate, DtypeName

log = logging.getLogger(__name__)
ItemT = TypeVar("ItemT")
OutputT = TypeVar("OutputT")


class ServiceComputeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = "cpu"  # torch device of base models and adapters: cpu, cuda, cuda:N or auto
    # Base weights; adapters and their optimizer stay float32 (the LoRA matmuls run in the base dtype, as
    # under autocast). "auto": bfloat16 where the device multiplies it natively (a CUDA GPU, a CPU with
    # AVX512-BF16 or AMX), else float32. Tiny model on this CPU (docs/benchmarks.md): bfloat16 trains
    # batches ~1.25x faster than float32; small single requests and sampling run 10-20% slower.
    dtype: DtypeName = "auto"
    # Padded tokens (rows x longest row) per forward/backward pass: bounds activation memory, which has no
    # checkpointing (a 7B model keeps a few MB per token). None: 2048 on CPU, where passes of 4096+ tokens
    # ran ~15% slower per token (caches spill; 256-2048 were alike), and 8192 on an accelerator; the
    # compute's `config` has it resolved.
    max_batch_tokens: int | None = Field(default=None, ge=1)
    max_sample_rows: int = Field(default=256, ge=1)  # sequences each base model's engine decodes together
    # The sampling engine keeps every row's K/V for the whole context, allocated at start: its rows are
    # max_sample_rows or as many as this budget holds (a 1.5M tiny model at 2048 tokens: 4 MiB per row).
    sample_kv_cache_mb: int = Field(default=512, ge=1)
    max_context_tokens: int | None = Field(default=None, ge=2)  # None: the model's max positions
    # False: no sampling engine in this process (another samples: `inflight serve --engine vllm`).
    sampling_engine: bool = True
    seed: int | None = None  # generator of unseeded samples; None = nondeterministic


class Compute(Protocol):
    """The compute as the worker and the app drive it: `ServiceCompute` in the serving process, or
    `launch/ray/compute.py`'s `RayCompute` forwarding each call to one in an actor (`inflight serve --launcher
    ray`). Paths name the service's state directory, which both must see. The in-process sampling engines
    (`ServiceCompute.sampling_engines`) are not part of it: only a compute in the serving process has them."""

    @property
    def config(self) -> ServiceComputeConfig: ...

    def base_model_names(self) -> list[str]: ...

    def tokenizer_dir(self, base_model: str) -> str: ...

    def model_info(self, base_model: str) -> dict[str, Any]: ...

    def create_adapter(self, model_id: str, base_model: str, lora: LoraSpec) -> None: ...

    def has_adapter(self, model_id: str) -> bool: ...

    def delete_adapter(self, model_id: str) -> None: ...

    def forward_backward(self, jobs: list[ForwardBackwardJob]) -> list[ForwardBackwardOutput | Exception]: ...

    def optim_step(self, step: OptimStep) -> dict[str, float]: ...

    def sampling_limits(self) -> dict[str, SamplingLimits]: ...

    def sampling_config(self, base_model: str) -> BuiltinEngineConfig: ...

    def sample_only_on(self, base_model: str, modules: Sequence[str]) -> None: ...

    def sampler_update(self, model_id: str, key: str) -> AdapterUpdate: ...

    def read_sampler_update(self, key: str, path: Path) -> tuple[str, AdapterUpdate]: ...

    def save_state(self, model_id: str, path: Path, include_optimizer: bool = True) -> int: ...

    def save_sampler_weights(self, model_id: str, path: Path) -> int: ...

    def load_state(self, model_id: str, path: Path, load_optimizer: bool) -> None: ...


@dataclass
class _Base:
    """One frozen base model, its tenants' adapters (the trainer's adapter set over it) and its tokenizer."""

    name: str
    source: str  # the directory or hub id it was loaded from
    adapters: AdapterSet
    sampling: BuiltinEngine | None  # its own copy of the base weights (None: sampled elsewhere)
    config: Any  # the Hugging Face model config
    tokenizer: Any
    vocab_size: int
    max_context: int
    eos_ids: tuple[int, ...]


class ServiceCompute:
    """Not thread-safe: one thread (the service's worker loop) calls it."""

    def __init__(
        self, base_models: dict[str, str], *, max_rank: int = 64, config: ServiceComputeConfig | None = None
    ) -> None:
        if not base_models:
            raise UserError("the service needs at least one base model (name -> model directory or hub id)")
        config = config or ServiceComputeConfig()
        self.max_rank = max_rank
        self._device = resolve_device(config.device, "device")
        # Resolved here, so that `config` says it (RayCompute and the app read it).
        self.max_batch_tokens: int = config.max_batch_tokens or (2048 if self._device.type == "cpu" else 8192)
        self.config = config.model_copy(update={"max_batch_tokens": self.max_batch_tokens})
        self._dtype = resolve_dtype(self.config.dtype, self._device)
        if self._dtype == torch.bfloat16 and not native_bfloat16(self._device):
            log.warning(
                "%s has no native bfloat16 matmuls: bfloat16 weights run slower than float32 here",
                self._device,
            )
        self._seed = secrets.randbits(63) if self.config.seed is None else self.config.seed
        self._bases = {name: self._load_base(name, source) for name, source in base_models.items()}
        self._owner: dict[str, str] = {}  # model_id -> the base model whose adapter set holds it
        self._tokenizer_tmp: tempfile.TemporaryDirectory | None = None
        # Batched passes that raised (each failed all its jobs with a server error), for the metrics.
        self.counters: dict[str, int] = {"failed_batches": 0, "batches_split": 0}

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
        if model_id in self._owner:
            raise UserError(f"model {model_id!r} already exists")
        self._base(base_model).adapters.create(model_id, lora)
        self._owner[model_id] = base_model

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self._owner

    def delete_adapter(self, model_id: str) -> None:
        """Drop the adapter and its optimizer state (idempotent). Its sampler snapshots stay usable."""
        base_model = self._owner.pop(model_id, None)
        if base_model is not None:
            self._bases[base_model].adapters.remove(model_id)

    def adapter_weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the adapter's A/B under PEFT names (for inspection and tests)."""
        return self._get_trained(model_id).adapter.state_dict()

    def adapter_gradients(self, model_id: str) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the accumulated gradients under PEFT names (zero after optim_step)."""
        return self._adapter_set(model_id).gradients(model_id)

    # ---- training ----------------------------------------------------------------------------------

    def forward_backward(self, jobs: list[ForwardBackwardJob]) -> list[ForwardBackwardOutput | Exception]:
        """One batched forward/backward per base model across all jobs, whatever adapter each uses.

        A job's bad input comes back as a UserError in its own slot; the other jobs still run. Gradients
        accumulate (sum) into each adapter until its optim_step; `backward=False` touches none.
        """
        results: list[ForwardBackwardOutput | Exception | None] = [None] * len(jobs)
        groups: dict[str, list[tuple[int, PreparedJob]]] = defaultdict(list)
        for i, job in enumerate(jobs):
            try:
                self._get_trained(job.model_id)
                base = self._bases[self._owner[job.model_id]]
                prepared = prepare_job(job, base.vocab_size, base.max_context)
            except UserError as exc:
                results[i] = UserError(f"forward_backward for model {job.model_id!r}: {exc}")
                continue
            groups[base.name].append((i, prepared))
        for base_name, items in groups.items():
            for (i, _), output in zip(items, self._forward_backward_group(base_name, items), strict=True):
                results[i] = output
        return _filled(results)

    def _forward_backward_group(
        self, base_name: str, items: Sequence[tuple[int, PreparedJob]]
    ) -> Sequence[ForwardBackwardOutput | Exception]:
        """One batched pass; if it fails, the gradients it added are taken back and each job runs alone,
        so a fault fails only the job that causes it. A lone job that fails keeps the gradients of the
        micro-batches that ran before the fault: its client sees a server error and decides (Tinker's
        clients usually retry the whole step)."""
        # What the adapters' gradients held before this pass, to take a failed pass's share back. A copy is
        # adapter-sized, small next to the pass's activations.
        adapters = self._bases[base_name].adapters
        saved = [
            (t, t.grad.clone())
            for model_id in {prepared.job.model_id for _, prepared in items}
            for t in adapters.get(model_id).adapter.parameters()
            if t.grad is not None and len(items) > 1
        ]

        def run(batch: Sequence[tuple[int, PreparedJob]]) -> Sequence[ForwardBackwardOutput]:
            return adapters.forward_backward([prepared for _, prepared in batch], self.max_batch_tokens)

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
        return self._adapter_set(step.model_id).optim_step(step)

    # ---- sampling ----------------------------------------------------------------------------------

    def sampling_engines(self) -> dict[str, tuple[BuiltinEngine, SamplingLimits]]:
        """Each base model's sampling engine (not yet stepped by anyone) and what its jobs must fit in."""
        limits = self.sampling_limits()
        engines = {}
        for name, base in self._bases.items():
            if base.sampling is None:
                raise RuntimeError("this compute was built without sampling engines (sampling_engine=False)")
            engines[name] = (base.sampling, limits[name])
        return engines

    def sampling_limits(self) -> dict[str, SamplingLimits]:
        """What each base model's sample jobs must fit in."""
        return {
            name: SamplingLimits(base.vocab_size, base.max_context, base.eos_ids)
            for name, base in self._bases.items()
        }

    def sampling_config(self, base_model: str) -> BuiltinEngineConfig:
        """The built-in engine configuration this base model samples with (also for one placed elsewhere)."""
        base = self._base(base_model)
        return self._sampling_config(base.name, base.config, base.max_context)

    def sample_only_on(self, base_model: str, modules: Sequence[str]) -> None:
        """Adapters of `base_model` may adapt only these modules (last name part): the LoRA layers the engine
        that samples them can adapt (vLLM's); an adapter asking for another is refused when created."""
        self._base(base_model).adapters.samplable = frozenset(modules)

    def sampler_update(self, model_id: str, key: str) -> AdapterUpdate:
        """The adapter's current weights as sampler weights named `key` (the engine copies them)."""
        return dataclasses.replace(self._adapter_set(model_id).adapter_update(model_id), name=key)

    def read_sampler_update(self, key: str, path: Path) -> tuple[str, AdapterUpdate]:
        """A checkpoint's adapter as sampler weights named `key`, with the base model it belongs to."""
        meta = read_meta(path)
        base = self._base(meta.base_model)
        trained = base.adapters.new(meta.lora)  # checks the spec against this server (rank, targets)
        try:
            trained.adapter.load_state_dict(read_adapter_tensors(path))
        except ValueError as exc:
            raise UserError(f"checkpoint {str(path)!r}: {exc}") from exc
        adapter = trained.adapter
        tensors = {name: t.detach() for name, t in adapter.named_parameters()}
        return meta.base_model, AdapterUpdate(key, trained.steps, adapter.rank, adapter.scale, tensors)

    # ---- checkpoints -------------------------------------------------------------------------------

    def save_state(self, model_id: str, path: Path, include_optimizer: bool = True) -> int:
        """Adapter (+ AdamW moments) to a PEFT-style directory, atomically; returns bytes written."""
        trained, base = self._get_trained(model_id), self._bases[self._owner[model_id]]
        meta = CheckpointMeta("state", base.name, trained.spec, include_optimizer, trained.steps)
        optimizer = trained.optimizer if include_optimizer else None
        return write_checkpoint(path, trained.adapter, meta, base.source, optimizer)

    def save_sampler_weights(self, model_id: str, path: Path) -> int:
        trained, base = self._get_trained(model_id), self._bases[self._owner[model_id]]
        meta = CheckpointMeta("sampler", base.name, trained.spec, False, trained.steps)
        return write_checkpoint(path, trained.adapter, meta, base.source, None)

    def load_state(self, model_id: str, path: Path, load_optimizer: bool) -> None:
        """Replace the adapter's weights (and AdamW state, or a fresh one) from a checkpoint; gradients are
        reset. Creates the adapter when `model_id` does not exist yet (create-via-load)."""
        meta = read_meta(path)
        if load_optimizer and not meta.has_optimizer:
            raise UserError(
                f"checkpoint {str(path)!r} holds no optimizer state ({meta.kind} checkpoint saved without "
                "it); load the weights only"
            )
        existing = self._get_trained(model_id) if model_id in self._owner else None
        existing_base = self._owner.get(model_id)
        if existing is not None and (existing_base, _shape(existing.spec)) != (
            meta.base_model,
            _shape(meta.lora),
        ):
            raise UserError(
                f"checkpoint {str(path)!r} is a {meta.lora} adapter of {meta.base_model!r}, but model "
                f"{model_id!r} is a {existing.spec} adapter of {existing_base!r}"
            )
        adapters = self._base(meta.base_model).adapters
        trained = adapters.new(existing.spec if existing else meta.lora)
        adapters.load_into(trained, path, load_optimizer, meta.optimizer_steps)
        # Only now: a failed load leaves the old adapter as it was.
        adapters.put(model_id, trained)
        self._owner[model_id] = meta.base_model

    # ---- internals ---------------------------------------------------------------------------------

    def _load_base(self, name: str, source: str) -> _Base:
        hf_model = load_model(source, dtype=self._dtype)
        config = hf_model.config
        model: torch.nn.Module = hf_model
        model.to(self._device).eval()
        if self._dtype != torch.float32:
            use_cpu_float32_attention(hf_model)  # no-op off CPU
        log.info("base model %r from %s: %s weights on %s", name, source, self._dtype, self._device)
        max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        if self.config.max_context_tokens is not None:
            max_context = min(max_context, self.config.max_context_tokens)
        tokenizer = load_tokenizer(source)
        # The sampling engine copies the weights first: the adapter set then wraps the model's layers.
        sampling = (
            BuiltinEngine(model, tokenizer, self._sampling_config(name, config, max_context))
            if self.config.sampling_engine
            else None
        )
        adapters = AdapterSet(model, self._device, max_rank=self.max_rank)
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
            adapters=adapters,
            sampling=sampling,
            config=config,
            tokenizer=tokenizer,
            vocab_size=int(config.vocab_size),
            max_context=max_context,
            eos_ids=tuple(sorted(eos)),
        )

    def _sampling_config(self, name: str, config: Any, max_context: int) -> BuiltinEngineConfig:
        """Rows: max_sample_rows, or fewer where the K/V of that many full contexts passes the budget."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_token = 2 * config.num_hidden_layers * heads * head_dim * self._dtype.itemsize
        row_mb = max_context * bytes_per_token / 2**20
        rows = min(self.config.max_sample_rows, int(self.config.sample_kv_cache_mb // row_mb))
        if rows < 1:
            raise UserError(
                f"base model {name!r}: one sequence of its {max_context}-token context needs "
                f"{row_mb:.0f} MiB of K/V, more than sample_kv_cache_mb={self.config.sample_kv_cache_mb}; "
                "raise the budget or bound the context (max_context_tokens)"
            )
        return BuiltinEngineConfig(
            max_batch_size=rows,
            max_seq_len_tokens=max_context,
            dtype="bfloat16" if self._dtype == torch.bfloat16 else "float32",
            device=str(self._device),
            seed=self._seed,
        )

    def _base(self, name: str) -> _Base:
        if name not in self._bases:
            raise UserError(f"unknown base model {name!r}; this server has: {', '.join(self._bases)}")
        return self._bases[name]

    def _adapter_set(self, model_id: str) -> AdapterSet:
        if model_id not in self._owner:
            raise UserError(f"unknown model {model_id!r}: create it (or load a checkpoint into it) first")
        return self._bases[self._owner[model_id]].adapters

    def _get_trained(self, model_id: str) -> TrainedAdapter:
        return self._adapter_set(model_id).get(model_id)


def _shape(spec: LoraSpec) -> tuple[object, ...]:
    """What makes two adapters' tensors interchangeable (the init seed does not)."""
    targets = None if spec.target_modules is None else tuple(spec.target_modules)
    return spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed, spec.alpha, targets


def _filled(results: Sequence[Any]) -> list[Any]:
    if any(r is None for r in results):
        raise RuntimeError("compute bug: a job got no result")
    return list(results)
