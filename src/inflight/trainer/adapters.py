"""An adapter set: LoRA adapters over one frozen base model, trained together. Each adapter has its own
AdamW state and step count; a batch may mix rows of several adapters in one pass (`models/lora.py` routes
each row), with each adapter's gradients and each Tinker job's loss exact (`tinker_pass.py`).

Both front ends train through it: the service keeps one set per base model with an adapter per tenant
model, the pipeline's LoRA policy one adapter in a set of its own. Knows nothing of requests, tenants or
run checkpoints; adapter files are `adapter_checkpoint.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inflight.errors import UserError
from inflight.models.lora import LoraPlan, LoraRouter, attach_multi_lora
from inflight.models.lora_adapter import LoraAdapter, select_targets
from inflight.trainer.adapter_checkpoint import optimizer_state_dict, read_adapter_tensors
from inflight.trainer.optim import adamw_step, new_adamw
from inflight.trainer.tinker_losses import PreparedJob
from inflight.trainer.tinker_pass import FbWork, run_forward_backward
from inflight.trainer.types import ForwardBackwardOutput, LoraSpec, OptimStep
from inflight.types import AdapterUpdate


@dataclass
class TrainedAdapter:
    """One adapter with its optimizer; `steps` counts the optimizer steps applied (its version)."""

    spec: LoraSpec
    adapter: LoraAdapter
    optimizer: torch.optim.AdamW
    steps: int = 0


class AdapterSet:
    """Adapters by name over `model`, whose LoRA-able linear layers are wrapped in place (the set owns the
    model from then on: `model` with no routing plan is the bare base). Not thread-safe."""

    def __init__(self, model: nn.Module, device: torch.device, max_rank: int = 64) -> None:
        self.model = model
        self.device = device
        self.max_rank = max_rank
        self.router: LoraRouter
        self.router, self.shapes = attach_multi_lora(model)
        self._adapters: dict[str, TrainedAdapter] = {}
        # The modules (last name part) the engine that samples these adapters can adapt; None: any.
        self.samplable: frozenset[str] | None = None

    # ---- the adapters ------------------------------------------------------------------------------

    def new(self, spec: LoraSpec) -> TrainedAdapter:
        """A fresh adapter for `spec` (B = 0: it starts equal to the base), not registered under any name."""
        if not 1 <= spec.rank <= self.max_rank:
            raise UserError(f"LoRA rank must be between 1 and {self.max_rank}, got {spec.rank}")
        shapes = select_targets(
            self.shapes, spec.train_attn, spec.train_mlp, spec.train_unembed, spec.target_modules
        )
        if not shapes:
            wanted = spec.target_modules or "train_attn, train_mlp or train_unembed"
            raise UserError(f"a LoRA adapter must train something: {wanted} matches no layer of the model")
        if self.samplable is not None:
            unsampled = sorted({n.rsplit(".", 1)[-1] for n in shapes} - self.samplable)
            if unsampled:
                fix = "train_unembed=False" if unsampled == ["lm_head"] else "target modules among those"
                cannot, can = ", ".join(unsampled), ", ".join(sorted(self.samplable))
                raise UserError(
                    f"this server samples with an engine (vLLM) whose LoRA cannot adapt {cannot} of this "
                    f"model (it adapts {can}): create the LoRA with {fix}"
                )
        adapter = LoraAdapter.create(shapes, spec.rank, spec.seed, self.device, alpha=spec.alpha)
        adapter.zero_grad_buffers()
        # lr etc. are placeholders: every optim_step sets its own hyper-parameters.
        optimizer = new_adamw(adapter.parameters())
        return TrainedAdapter(spec=spec, adapter=adapter, optimizer=optimizer)

    def create(self, name: str, spec: LoraSpec) -> TrainedAdapter:
        if name in self._adapters:
            raise UserError(f"model {name!r} already exists")
        self._adapters[name] = trained = self.new(spec)
        return trained

    def put(self, name: str, trained: TrainedAdapter) -> None:
        """Register `trained` under `name`, replacing what was there (its gradients and optimizer go)."""
        self._adapters[name] = trained

    def remove(self, name: str) -> None:
        """Drop the adapter and its optimizer state (idempotent)."""
        self._adapters.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def get(self, name: str) -> TrainedAdapter:
        if name not in self._adapters:
            raise UserError(f"unknown model {name!r}: create it (or load a checkpoint into it) first")
        return self._adapters[name]

    def load_into(self, trained: TrainedAdapter, path: Path, load_optimizer: bool, steps: int) -> None:
        """Weights (and AdamW moments, with `steps` applied) from an adapter checkpoint directory."""
        try:
            trained.adapter.load_state_dict(read_adapter_tensors(path))
        except ValueError as exc:
            raise UserError(f"checkpoint {str(path)!r}: {exc}") from exc
        if load_optimizer:
            state = optimizer_state_dict(path, trained.adapter, trained.optimizer)
            trained.optimizer.load_state_dict(state)
            trained.steps = steps

    # ---- training ----------------------------------------------------------------------------------

    @contextmanager
    def routing(self, row_adapters: Sequence[str | None]) -> Iterator[None]:
        """Forward passes inside run row b through adapter `row_adapters[b]` (None: the bare base)."""
        slots: list[LoraAdapter | None] = []
        index: dict[str | None, int] = {}
        for name in row_adapters:
            if name not in index:
                index[name] = len(slots)
                slots.append(None if name is None else self.get(name).adapter)
        with self.router.use(LoraPlan(slots, [index[name] for name in row_adapters])):
            yield

    def forward_backward(
        self, jobs: Sequence[PreparedJob], max_batch_tokens: int
    ) -> list[ForwardBackwardOutput]:
        """Tinker's forward_backward of every job (each names its adapter: `job.job.model_id`) in batched
        passes; gradients of jobs with `backward` accumulate (sum) into their adapters until optim_step."""
        slots: list[LoraAdapter | None] = []
        index: dict[str, int] = {}
        work = []
        for prepared in jobs:
            name = prepared.job.model_id
            if name not in index:
                index[name] = len(slots)
                slots.append(self.get(name).adapter)
            work.append(FbWork(prepared, slot=index[name]))
        return run_forward_backward(self.model, self.router, slots, work, max_batch_tokens, self.device)

    def optim_step(self, step: OptimStep) -> dict[str, float]:
        """AdamW exactly like torch.optim.AdamW with this step's hyper-parameters (after clipping the
        adapter's gradient norm when grad_clip_norm > 0), then zero its gradients. A gradient that is not
        finite is discarded instead, and the step refused (`adamw_step`'s refuse_non_finite)."""
        trained = self.get(step.model_id)
        grad_norm = adamw_step(trained.optimizer, trained.adapter.parameters(), step, refuse_non_finite=True)
        trained.adapter.zero_grad_buffers()
        trained.steps += 1
        return {
            "grad_norm:mean": float(grad_norm),
            "learning_rate:mean": step.learning_rate,
            "optimizer_step:max": float(trained.steps),
        }

    def adapter_update(self, name: str, version: int | None = None) -> AdapterUpdate:
        """The adapter's weights for an engine (`set_adapter`): PEFT names, detached, on the set's device
        (the engine copies what it keeps); `version` defaults to its optimizer steps."""
        trained = self.get(name)
        adapter = trained.adapter
        return AdapterUpdate(
            name=name,
            version=trained.steps if version is None else version,
            rank=adapter.rank,
            scale=adapter.scale,
            tensors={key: t.detach() for key, t in adapter.named_parameters()},
        )

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The frozen base's weights under Hugging Face names (the wrappers' `.base.` left out), detached:
        what an engine that applies adapters itself loads."""
        wrapped = {f"{name}.base": name for name in self.shapes}
        out = {}
        for key, t in self.model.state_dict().items():
            prefix, _, leaf = key.rpartition(".")
            out[f"{wrapped[prefix]}.{leaf}" if prefix in wrapped else key] = t.detach()
        return out

    def gradients(self, name: str) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the accumulated gradients under PEFT names (zero after optim_step)."""
        adapter = self.get(name).adapter
        return {
            key: (t.grad if t.grad is not None else torch.zeros_like(t)).detach().cpu().clone()
            for key, t in adapter.named_parameters()
        }
