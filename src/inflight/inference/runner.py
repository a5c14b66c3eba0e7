"""The seam between the engine and a forward pass: the `ModelRunner` interface, and which runner a model gets.

The engine owns requests, sampling, versions and which adapter each request uses; a runner owns the weights,
the adapters' device copies, the numerics and a KV cache of `max_batch_size` rows, of which the engine's
active sequences occupy rows 0..n-1. Two implementations: `qwen2.Qwen2Runner` (the engine's own forward:
Qwen2/Qwen2.5, Qwen3, Llama, Mistral; fast) and `hf_runner.HFRunner` (the model's own Hugging Face forward:
any causal LM with a key/value cache; slower).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from inflight.errors import UserError
from inflight.inference.adapters import AdapterModules, ModuleShapes
from inflight.inference.config import RunnerChoice

log = logging.getLogger(__name__)

W = TypeVar("W")  # a runner's weight snapshot
A = TypeVar("A")  # a runner's copy of one LoRA adapter (immutable: replacing an adapter makes a new one)


class ModelRunner(ABC, Generic[W, A]):
    """Prefill and decode over cache rows, each row with its own adapter (None: the base weights).

    Called from the engine's driver thread only, except `snapshot` and `snapshot_adapter`.
    """

    name: str  # "fast" or "hf": which implementation runs (EngineMetrics, logs)
    # Whether `prefill_after` works: prefilling a prompt whose first tokens' K/V are already in its row.
    resumes_cached_prefix: bool = False
    vocab_size: int
    device: torch.device
    optional_update_names: frozenset[str]  # parameters a WeightUpdate may leave out (tied copies)
    lora_shapes: ModuleShapes  # modules (HF names) a LoRA adapter may target -> (in, out); {}: none

    @abstractmethod
    def snapshot(self, state_dict: dict[str, Tensor]) -> W:
        """The runner's own copy of these weights (its dtype and device). Any thread; the caller may keep
        mutating its tensors."""

    @abstractmethod
    def install(self, weights: W) -> None:
        """Make `weights` the ones every later forward uses (between two steps, never within one)."""

    @abstractmethod
    def snapshot_adapter(self, modules: AdapterModules, scale: float) -> A:
        """The runner's own copy of one adapter (validated by `adapters.parse_adapter`). Any thread."""

    @abstractmethod
    def prefill(
        self, prompts: list[list[int]], row0: int, adapters: Sequence[A | None], full_rows: Sequence[int] = ()
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Logits [b, V] (float32) at each prompt's last token, and for each index in `full_rows` the logits
        [P, V] at every position of that prompt (prompt logprobs, from this same pass); writes the K/V of
        rows row0..row0+b-1."""

    def prefill_after(
        self, prompts: list[list[int]], cached: Sequence[int], row0: int, adapters: Sequence[A | None]
    ) -> Tensor:
        """Like `prefill` (logits [b, V] at each prompt's last token), for rows row0.. whose first
        `cached[i]` positions already hold prompt i's K/V (0 <= cached[i] < len(prompt i)): only the rest
        is computed and cached. Only where `resumes_cached_prefix`."""
        raise NotImplementedError(f"the {self.name} runner cannot resume a cached prefix")

    def decode_and_prefill(
        self,
        tokens: list[int],
        positions: list[int],
        prompts: list[list[int]],
        cached: Sequence[int],
        adapters: Sequence[A | None],
    ) -> Tensor:
        """`decode(tokens, positions, adapters[:n])` for rows 0..n-1 and `prefill_after(prompts, cached, n,
        adapters[n:])` for the rows after them, in one pass: logits [n + b, V] (float32), the decoded rows'
        then each prompt's at its last token. Only where `resumes_cached_prefix`."""
        raise NotImplementedError(f"the {self.name} runner cannot decode and prefill in one pass")

    @abstractmethod
    def fill_cache(self, prefixes: list[list[int]], row0: int, adapters: Sequence[A | None]) -> None:
        """Recompute the K/V of rows row0.. from their token prefixes with the current weights (no logits)."""

    @abstractmethod
    def decode(self, tokens: list[int], positions: list[int], adapters: Sequence[A | None]) -> Tensor:
        """One token for each of rows 0..n-1 at its own position (= the row's cached length); returns
        logits [n, V] (float32, on the runner's device) and caches the tokens' K/V."""

    @abstractmethod
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of row `src` into row `dst`."""

    @abstractmethod
    def clear_row(self, row: int) -> None:
        """Zero every cached position of `row`. Attention hides a row's stale positions with an additive
        -inf, which a NaN left there by weights that diverged would turn into NaN for the next occupant."""

    @abstractmethod
    def full_logits(self, token_ids: list[int], adapter: A | None = None) -> Tensor:
        """Logits [T, V] (float32) at every position of one sequence; the cache is untouched."""


def build_runner(
    model: Any,
    choice: RunnerChoice,
    dtype: torch.dtype,
    max_batch_size: int,
    max_seq_len: int,
    device: torch.device,
) -> ModelRunner[Any, Any]:
    """The fast runner where it reproduces the model exactly, else (with choice "auto") the generic one.

    Both copy the weights (onto `device`); the model itself is never touched afterwards.
    """
    from inflight.inference.hf_runner import HFRunner
    from inflight.inference.qwen2 import Qwen2Runner, UnsupportedModel

    if choice != "hf":
        try:
            return Qwen2Runner.from_model(model, dtype, max_batch_size, max_seq_len, device)
        except UnsupportedModel as exc:
            if choice == "fast":
                raise UserError(f"engine.runner=fast: {exc}; use engine.runner=auto (or hf)") from exc
            log.warning("%s runs on the generic Hugging Face path (slower): %s", type(model).__name__, exc)
    return HFRunner(model, dtype, max_batch_size, max_seq_len, device)
