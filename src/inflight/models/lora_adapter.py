"""One LoRA adapter's parameters: A/B per target module, their init, and PEFT-style tensor names.

Owns the numbers of one adapter only; which rows of a batch use which adapter is `lora.py`'s job, and
optimizers and files belong to the caller.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from inflight.models.lora_targets import ATTN_TARGETS, LORA_ALPHA, MLP_TARGETS, UNEMBED_TARGETS

# module name -> (in_features, out_features)
ModuleShapes = Mapping[str, tuple[int, int]]


def peft_key(module: str, which: str) -> str:
    """The tensor name PEFT writes in adapter_model.safetensors, e.g. `...q_proj.lora_A.weight`."""
    return f"base_model.model.{module}.lora_{which}.weight"


def split_peft_key(key: str) -> tuple[str, str] | None:
    """(module, "A" or "B") of a name `peft_key` writes; None for any other name."""
    prefix = "base_model.model."
    for which in "AB":
        suffix = f".lora_{which}.weight"
        if key.startswith(prefix) and key.endswith(suffix):
            return key[len(prefix) : -len(suffix)], which
    return None


def select_targets(
    shapes: ModuleShapes,
    train_attn: bool,
    train_mlp: bool,
    train_unembed: bool,
    suffixes: Iterable[str] | None = None,
) -> dict[str, tuple[int, int]]:
    """The modules of `shapes` that an adapter trains: those named by `suffixes` (e.g. "q_proj") when given,
    else those of the Tinker flags' groups."""
    if suffixes is None:
        suffixes = (
            (ATTN_TARGETS if train_attn else ())
            + (MLP_TARGETS if train_mlp else ())
            + (UNEMBED_TARGETS if train_unembed else ())
        )
    wanted = set(suffixes)
    return {name: shape for name, shape in shapes.items() if name.rsplit(".", 1)[-1] in wanted}


@dataclass
class LoraAdapter:
    """A [r, in] and B [out, r] (float32 leaf tensors) per module; delta(x) = scale * B A x."""

    rank: int
    modules: dict[str, tuple[Tensor, Tensor]]  # module name -> (A, B)
    alpha: float = LORA_ALPHA  # PEFT's lora_alpha: the output is scaled by alpha / rank

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def create(
        cls,
        shapes: ModuleShapes,
        rank: int,
        seed: int | None = None,
        device: str | torch.device = "cpu",
        alpha: float = LORA_ALPHA,
    ) -> LoraAdapter:
        """A fresh trainable adapter: A ~ PEFT's default init, B = 0, so it starts equal to the base model.

        PEFT initialises A with kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)). The draws come
        from a generator seeded with `seed` (None: a random seed) in sorted module order, so the same seed
        gives the same adapter whatever the global RNG state.
        """
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
        modules = {}
        for name in sorted(shapes):
            fan_in, fan_out = shapes[name]
            bound = 1.0 / math.sqrt(fan_in)
            a = (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound
            b = torch.zeros(fan_out, rank)
            modules[name] = (a.to(device).requires_grad_(), b.to(device).requires_grad_())
        return cls(rank=rank, modules=modules, alpha=alpha)

    def parameters(self) -> list[Tensor]:
        """A, B of every module in sorted module order: the optimizer's (and its state's) fixed order."""
        return [t for name in sorted(self.modules) for t in self.modules[name]]

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """(PEFT name, tensor) in `parameters()` order."""
        return [
            (peft_key(name, which), t)
            for name in sorted(self.modules)
            for which, t in zip("AB", self.modules[name], strict=True)
        ]

    def state_dict(self) -> dict[str, Tensor]:
        """Detached float32 CPU copies under PEFT names (what adapter_model.safetensors holds)."""
        return {key: t.detach().to("cpu", torch.float32, copy=True) for key, t in self.named_parameters()}

    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy `tensors` (PEFT names, exactly this adapter's set and shapes) into the parameters in place."""
        expected = dict(self.named_parameters())
        missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or unknown:
            raise ValueError(
                f"adapter tensors do not match this LoRA config (rank {self.rank}, {len(self.modules)} "
                f"modules): missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                f"unexpected {unknown[:4]}{'...' if len(unknown) > 4 else ''}"
            )
        wrong = [
            f"{key} {tuple(tensors[key].shape)} (expected {tuple(t.shape)})"
            for key, t in expected.items()
            if tensors[key].shape != t.shape
        ]
        if wrong:
            raise ValueError(f"adapter tensors have wrong shapes: {wrong[:4]}")
        with torch.no_grad():
            for key, t in expected.items():
                t.copy_(tensors[key])

    def frozen_copy(self) -> LoraAdapter:
        """A snapshot that later training of this adapter does not change (no grad)."""
        return LoraAdapter(
            rank=self.rank,
            modules={name: (a.detach().clone(), b.detach().clone()) for name, (a, b) in self.modules.items()},
            alpha=self.alpha,
        )

    def zero_grad_buffers(self) -> None:
        """Allocate (or zero) a gradient buffer for every parameter.

        Keeping buffers allocated (never None) means every optimizer step updates every parameter, also
        one that a step's batch did not reach, so all of an adapter's parameters share one step count.
        """
        for t in self.parameters():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
            else:
                t.grad.zero_()


def target_suffixes(modules: Iterable[str]) -> list[str]:
    """Sorted distinct last name parts, the `target_modules` of a PEFT adapter_config.json."""
    return sorted({name.rsplit(".", 1)[-1] for name in modules})
