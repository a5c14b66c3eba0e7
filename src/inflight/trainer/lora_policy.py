"""The pipeline Trainer's LoRA policy: one adapter in an adapter set of its own over the frozen base.

The reference for KL is the base itself (the adapter switched off: no copy of the model). The engine
receives either the adapter (`adapter_update`, PEFT names) or the merged full weights (`weights`), and a
run checkpoint holds the adapter as a PEFT directory with its AdamW state (`adapter_checkpoint.py`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor, nn

from inflight.trainer.adapter_checkpoint import write_adapter_files
from inflight.trainer.adapters import AdapterSet
from inflight.trainer.optim import adamw_step
from inflight.trainer.types import LoraSpec, OptimStep
from inflight.types import AdapterUpdate

ADAPTER_NAME = "policy"


class LoraPolicy:
    """`model`'s LoRA-able layers are wrapped in place: the policy owns the model from then on."""

    def __init__(self, model: nn.Module, spec: LoraSpec, device: torch.device) -> None:
        self.adapters = AdapterSet(model, device, max_rank=spec.rank)
        self.model = model
        self.trained = self.adapters.create(ADAPTER_NAME, spec)
        self.optimizer: torch.optim.Optimizer = self.trained.optimizer

    def routing(self, rows: int) -> AbstractContextManager[None]:
        return self.adapters.routing([ADAPTER_NAME] * rows)

    def reference_model(self) -> nn.Module:
        return self.model  # with no adapter routed, the wrapped layers are exactly the base

    def reference_routing(self, rows: int) -> AbstractContextManager[None]:
        return self.adapters.routing([None] * rows)

    def parameters(self) -> list[Tensor]:
        return self.trained.adapter.parameters()

    def optim_step(self, step: OptimStep) -> Tensor:
        grad_norm = adamw_step(self.optimizer, self.parameters(), step)
        self.trained.adapter.zero_grad_buffers()
        self.trained.steps += 1
        return grad_norm

    def weights(self) -> dict[str, Tensor]:
        """The merged model W + (alpha / r) B A under Hugging Face names: what an engine without adapters
        serves (the wrapped layers' `.base.` drops out of the names)."""
        adapter = self.trained.adapter
        out = self.adapters.base_weights()
        with torch.no_grad():
            for module, (a, b) in adapter.modules.items():
                weight = out[f"{module}.weight"]
                out[f"{module}.weight"] = weight + (adapter.scale * (b @ a)).to(weight.dtype)
        return out

    def adapter_update(self, version: int) -> AdapterUpdate:
        return self.adapters.adapter_update(ADAPTER_NAME, version)

    def save(self, directory: Path) -> list[str]:
        source = str(getattr(self.model.config, "_name_or_path", "") or "")
        return write_adapter_files(directory, self.trained.adapter, source, self.optimizer)

    def load(self, directory: Path, load_optimizer: bool) -> None:
        self.adapters.load_into(self.trained, directory, load_optimizer, steps=self.trained.steps)
