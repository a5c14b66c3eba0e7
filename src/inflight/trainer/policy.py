"""The pipeline Trainer's trained parameters, behind one small interface: the whole model (`FullPolicy`,
here) or one LoRA adapter over a frozen base (`lora_policy.LoraPolicy`).

A policy owns the parameters, their optimizer, how a forward pass reaches them (`routing`), the frozen
reference for KL, what the engine receives, and its files in a run checkpoint. The loss, micro-batching and
versions are the Trainer's; the policy never sees a sample.
"""

from __future__ import annotations

import contextlib
import copy
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from inflight.errors import UserError
from inflight.trainer.optim import adamw_step, new_adamw
from inflight.trainer.types import OptimStep
from inflight.types import AdapterUpdate

WEIGHTS = "model.safetensors"  # Hugging Face's name: the directory loads with from_pretrained
MODEL_CONFIG = "config.json"
OPTIMIZER = "optimizer.pt"


class Policy(Protocol):
    """What the Trainer trains. `model` is a Hugging Face causal LM on the trainer's device."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def routing(self, rows: int) -> AbstractContextManager[None]:
        """Forward passes of `rows` rows inside run through the trained weights."""
        ...

    def reference_model(self) -> nn.Module:
        """The frozen reference model (for KL); UserError when this policy keeps none."""
        ...

    def reference_routing(self, rows: int) -> AbstractContextManager[None]:
        """Forward passes of `rows` rows of the reference model inside run through the reference weights."""
        ...

    def parameters(self) -> list[Tensor]: ...

    def optim_step(self, step: OptimStep) -> Tensor:
        """AdamW with these hyper-parameters, then zero the gradients; the gradient norm before clipping."""
        ...

    def weights(self) -> dict[str, Tensor]:
        """Every weight of the full model by Hugging Face name, detached (the engine copies what it keeps)."""
        ...

    def adapter_update(self, version: int) -> AdapterUpdate: ...

    def save(self, directory: Path) -> list[str]:
        """Write the policy's files into `directory`; returns their names."""
        ...

    def load(self, directory: Path, load_optimizer: bool) -> None: ...


class FullPolicy:
    """Every parameter of the model trains; the reference (kept only when `keep_reference`) is a frozen deep
    copy of the weights at construction, i.e. after any warm-up the caller did before building the trainer."""

    def __init__(self, model: nn.Module, keep_reference: bool) -> None:
        self.model = model
        # Hyper-parameters are set by every optim_step (a schedule changes lr per step).
        self.optimizer: torch.optim.Optimizer = new_adamw(self.parameters())
        self.ref_model: nn.Module | None = None
        if keep_reference:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    def routing(self, rows: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reference_routing(self, rows: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reference_model(self) -> nn.Module:
        if self.ref_model is None:
            raise UserError(
                "full-parameter training keeps a reference model only with trainer.loss.kl_coef > 0 (it "
                "costs a copy of the model); set kl_coef, or train LoRA (trainer.lora_rank), whose "
                "reference is the base"
            )
        return self.ref_model

    def parameters(self) -> list[Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def optim_step(self, step: OptimStep) -> Tensor:
        params = self.parameters()
        grad_norm = adamw_step(self.optimizer, params, step)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def weights(self) -> dict[str, Tensor]:
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def adapter_update(self, version: int) -> AdapterUpdate:
        raise UserError("trainer.lora_rank=0 trains the full model, which has no adapter: use weights()")

    def save(self, directory: Path) -> list[str]:
        # safetensors refuses shared storage; contiguous clones keep tied weights writable too.
        state = {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}
        save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
        self.model.config.to_json_file(str(directory / MODEL_CONFIG))  # type: ignore[union-attr,operator]
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER)
        return [WEIGHTS, MODEL_CONFIG, OPTIMIZER]

    def load(self, directory: Path, load_optimizer: bool) -> None:
        weights = load_file(str(directory / WEIGHTS))
        optimizer = torch.load(directory / OPTIMIZER, weights_only=True) if load_optimizer else None
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise UserError(
                f"checkpoint {directory} does not match the model: missing={missing} unexpected={unexpected}"
            )
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
