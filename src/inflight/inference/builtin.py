"""The built-in engine: request lifecycle (waiting -> cache row -> finished), stop conditions, per-token
versions, weight swaps between steps and the KV policy of sequences in flight across a swap. The forward
pass is a `runner.ModelRunner` (`qwen2.py` for the families it reproduces, else `hf_runner.py`), sampling
is `sampling.py`. One driver thread calls step()/generate(); add_request, abort, update_weights and
metrics are thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from inflight.inference.runner import ModelRunner, RunnerChoice, build_runner
from inflight.inference.sampling import sample
from inflight.types import Completion, FinishReason, SampleRequest, WeightUpdate


class BuiltinEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=64, ge=1)  # cache rows = sequences decoded together
    # Prompt + completion: the cache length; a sequence that reaches it stops with "length".
    max_seq_len_tokens: int = Field(default=1024, ge=2)
    dtype: Literal["float32", "bfloat16"] = "float32"  # weights, activations and KV cache
    seed: int = 0  # the generator of requests without their own seed
    # What an update does to the K/V cache of sequences in flight (PipelineRL and OlmoRL always keep it):
    # "keep": they go on reading K/V computed by older weights; no pause, but every later token of theirs is
    #   generated on a stale prefix (counted: EngineMetrics.tokens_on_stale_kv).
    # "recompute": before the next decode step their prefixes are re-prefilled under the new weights,
    #   batched; the step loop pauses for that long, and their continuation is exactly what the new weights
    #   give for that prefix.
    kv_policy: Literal["keep", "recompute"] = "keep"
    # Recompute runs over consecutive rows in chunks of at most this many padded tokens (but at least one
    # row), which bounds the activation memory of a large batch of long sequences.
    recompute_chunk_tokens: int = Field(default=16384, ge=1)
    recent_updates_kept: int = Field(default=32, ge=0)  # UpdateRecords kept for metrics()
    # The forward pass. "fast": the engine's own (Qwen2/Qwen2.5, Qwen3, Llama incl. Llama 3 rope scaling,
    # Mistral). "hf": the model's Hugging Face forward with its KV cache: any causal LM, slower. "auto":
    # fast where it reproduces the model exactly, else hf (with a one-line warning saying why).
    runner: RunnerChoice = "auto"


@dataclass
class _Sequence:
    request: SampleRequest
    generator: torch.Generator | None  # None: draws from the engine's generator
    num_cached: int = 0  # positions whose K/V are in the cache; the last sampled token is not yet
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_text: str | None = None  # the completion text cut before the stop string that ended it
    kv_version: int = 0  # oldest weight version among this sequence's cached K/V entries


@dataclass(frozen=True)
class UpdateRecord:
    """One installed weight update, as the step loop saw it."""

    version: int
    pause_s: float  # step-loop time spent installing it, recompute included (generation stood still)
    copy_s: float  # update_weights' copy into engine tensors (the caller's thread; not a pause)
    sequences_recomputed: int  # sequences in flight whose cache was recomputed ("recompute" policy)
    tokens_recomputed: int  # cache positions recomputed


@dataclass(frozen=True)
class EngineMetrics:
    """Counters since the engine started (a snapshot; all times in seconds)."""

    version: int
    kv_policy: str
    runner: str  # the forward pass in use: "fast" or "hf"
    num_running: int  # sequences in cache rows
    num_waiting: int  # requests not yet admitted
    tokens_generated: int
    # Tokens sampled while their sequence's cache held K/V from an older version than the one sampling.
    tokens_on_stale_kv: int
    busy_s: float  # wall time inside step() that had work to do
    updates_received: int  # update_weights calls accepted
    updates_applied: int  # installed at a step boundary
    updates_superseded: int  # replaced by a newer update before any step installed them
    update_pause_s_total: float
    update_pause_s_max: float
    update_copy_s_total: float
    sequences_recomputed: int
    tokens_recomputed: int
    recent_updates: tuple[UpdateRecord, ...]  # the latest ones, oldest first

    @property
    def stale_kv_token_frac(self) -> float:
        return self.tokens_on_stale_kv / self.tokens_generated if self.tokens_generated else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def updates_consumed(self) -> int:
        """Updates no longer pending: applied or superseded. Equals updates_received once a step ran."""
        return self.updates_applied + self.updates_superseded


@dataclass
class _Counters:
    """Mutable totals behind EngineMetrics; written by the driver thread (update_* under the lock)."""

    tokens_generated: int = 0
    tokens_on_stale_kv: int = 0
    busy_s: float = 0.0
    updates_received: int = 0
    updates_applied: int = 0
    updates_superseded: int = 0
    update_pause_s_total: float = 0.0
    update_pause_s_max: float = 0.0
    update_copy_s_total: float = 0.0
    sequences_recomputed: int = 0
    tokens_recomputed: int = 0


class BuiltinEngine:
    """Continuous-batching engine on CPU over a Hugging Face causal LM (weights copied).

    Stops only where asked: add the EOS id to `SamplingParams.stop_token_ids` to stop at EOS.
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: BuiltinEngineConfig | None = None) -> None:
        self.config = config or BuiltinEngineConfig()
        self._dtype = torch.float32 if self.config.dtype == "float32" else torch.bfloat16
        self._param_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self._runner: ModelRunner[Any] = build_runner(
            model, self.config.runner, self._dtype, self.config.max_batch_size, self.config.max_seq_len_tokens
        )
        self._tokenizer = tokenizer
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._version = 0
        self._running: list[_Sequence] = []  # index = cache row; rows 0..n-1 are exactly the active ones
        # Shared with other threads, under _lock:
        self._lock = threading.Lock()
        self._waiting: deque[SampleRequest] = deque()
        self._in_flight: set[str] = set()  # request ids waiting or running
        self._aborts: set[str] = set()
        self._pending: tuple[int, Any, float] | None = None  # version, runner's weight snapshot, copy seconds
        self._counters = _Counters()
        self._recent_updates: deque[UpdateRecord] = deque(maxlen=self.config.recent_updates_kept)

    @property
    def version(self) -> int:
        return self._version

    @property
    def runner(self) -> str:
        """The forward pass in use: "fast" (the engine's own) or "hf" (the model's Hugging Face forward)."""
        return self._runner.name

    def add_request(self, request: SampleRequest) -> None:
        self._validate(request)
        with self._lock:
            if request.request_id in self._in_flight:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._in_flight.add(request.request_id)
            self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Finish the request at the next step with reason "abort" (ignored if it is no longer in flight)."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    def has_pending_update(self) -> bool:
        """True while an update waits for the next step() to install it."""
        with self._lock:
            return self._pending is not None

    def metrics(self) -> EngineMetrics:
        with self._lock:
            return EngineMetrics(
                version=self._version,
                kv_policy=self.config.kv_policy,
                runner=self._runner.name,
                num_running=len(self._running),
                num_waiting=len(self._waiting),
                recent_updates=tuple(self._recent_updates),
                **asdict(self._counters),
            )

    def generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        if self.has_unfinished():
            raise RuntimeError("generate() drives the engine alone; with requests in flight use step()")
        for request in requests:
            self._validate(request)
        for request in requests:
            self.add_request(request)
        done: dict[str, Completion] = {}
        while self.has_unfinished():
            done.update((c.request_id, c) for c in self.step())
        return [done[r.request_id] for r in requests]

    def update_weights(self, update: WeightUpdate) -> None:
        """Validate and copy now, in the caller's thread; the next step() installs them. Latest call wins."""
        self._check_names(update)
        start = time.perf_counter()
        with torch.inference_mode():
            weights = self._runner.snapshot(update.state_dict)
        copy_s = time.perf_counter() - start
        with self._lock:
            if self._pending is not None:
                self._counters.updates_superseded += 1
            self._pending = (update.version, weights, copy_s)
            self._counters.updates_received += 1
            self._counters.update_copy_s_total += copy_s

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """schedule -> execute -> update; returns the requests that finished in this step."""
        start = time.perf_counter()
        finished, num_new = self._schedule()
        if self._running:
            token_ids, logprobs = self._execute(num_new)
            finished += self._update(token_ids, logprobs)
        if self._running or finished:
            with self._lock:
                self._counters.busy_s += time.perf_counter() - start
        return finished

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """[T] log p(token_t | tokens_<t) at temperature 1, current weights; [0] is NaN (no prefix)."""
        self._validate(SampleRequest(prompt_token_ids=token_ids), room_for_completion=False)
        logprobs = torch.log_softmax(self._runner.full_logits(token_ids)[:-1], dim=-1)
        targets = torch.tensor(token_ids[1:], dtype=torch.long)[:, None]
        return [math.nan, *logprobs.gather(1, targets).squeeze(1).tolist()]

    def _schedule(self) -> tuple[list[Completion], int]:
        """Apply aborts and a pending update, then admit waiting requests into free rows (appended last)."""
        with self._lock:
            pending, self._pending = self._pending, None
            aborts, self._aborts = self._aborts, set()
            aborted = [r for r in self._waiting if r.request_id in aborts]
            for request in aborted:
                self._waiting.remove(request)
            free = self.config.max_batch_size - len(self._running)
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        finished = [self._finish(_Sequence(r, None), "abort") for r in aborted]
        for request_id in aborts:
            row = next((i for i, s in enumerate(self._running) if s.request.request_id == request_id), None)
            if row is not None:
                finished.append(self._free_row(row, "abort"))
        if pending is not None:
            self._install(*pending)  # after the aborts: their rows need no recompute
        for request in admitted:
            seed = request.params.seed
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            self._running.append(_Sequence(request, generator, kv_version=self._version))
        return finished, len(admitted)

    def _install(self, version: int, weights: Any, copy_s: float) -> None:
        """Swap weights between two decode steps (a step never mixes two versions), then apply the KV
        policy to the sequences in flight."""
        start = time.perf_counter()
        self._runner.install(weights)
        self._version = version
        recomputed = 0
        if self.config.kv_policy == "recompute" and self._running:
            recomputed = self._recompute_cache()
        pause_s = time.perf_counter() - start
        record = UpdateRecord(version, pause_s, copy_s, len(self._running) if recomputed else 0, recomputed)
        with self._lock:
            c = self._counters
            c.updates_applied += 1
            c.update_pause_s_total += pause_s
            c.update_pause_s_max = max(c.update_pause_s_max, pause_s)
            c.sequences_recomputed += record.sequences_recomputed
            c.tokens_recomputed += recomputed
            self._recent_updates.append(record)

    def _recompute_cache(self) -> int:
        """Re-prefill every running row's cached prefix with the current weights; returns positions redone.

        A row caches prompt + generated tokens except the newest one (decode feeds that one next step).
        """
        prefixes = [(s.request.prompt_token_ids + s.token_ids)[: s.num_cached] for s in self._running]
        row0 = 0
        while row0 < len(prefixes):
            # Consecutive rows while the padded chunk (rows x longest prefix) fits the token budget.
            row1, longest = row0 + 1, len(prefixes[row0])
            while row1 < len(prefixes):
                longest_next = max(longest, len(prefixes[row1]))
                if (row1 + 1 - row0) * longest_next > self.config.recompute_chunk_tokens:
                    break
                row1, longest = row1 + 1, longest_next
            self._runner.fill_cache(prefixes[row0:row1], row0=row0)
            row0 = row1
        for seq in self._running:
            seq.kv_version = self._version
        return sum(len(p) for p in prefixes)

    def _execute(self, num_new: int) -> tuple[Tensor, Tensor]:
        """Decode one token for rows admitted earlier, prefill the newcomers, sample for all rows."""
        num_old = len(self._running) - num_new
        old, new = self._running[:num_old], self._running[num_old:]
        logits = []
        if old:
            tokens = torch.tensor([s.token_ids[-1] for s in old])
            positions = torch.tensor([s.num_cached for s in old])
            logits.append(self._runner.decode(tokens, positions))
            for s in old:
                s.num_cached += 1
        if new:
            logits.append(self._runner.prefill([s.request.prompt_token_ids for s in new], row0=num_old))
            for s in new:
                s.num_cached = len(s.request.prompt_token_ids)
        return sample(
            torch.cat(logits) if len(logits) > 1 else logits[0],
            [s.request.params for s in self._running],
            [s.generator for s in self._running],
            self._generator,
        )

    def _update(self, token_ids: Tensor, logprobs: Tensor) -> list[Completion]:
        finishing: list[tuple[int, FinishReason]] = []
        stale = 0
        rows = zip(self._running, token_ids.tolist(), logprobs.tolist(), strict=True)
        for row, (seq, token, logprob) in enumerate(rows):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self._version)
            stale += seq.kv_version < self._version
            reason = self._stop_reason(seq)
            if reason is not None:
                finishing.append((row, reason))
        with self._lock:
            self._counters.tokens_generated += len(self._running)
            self._counters.tokens_on_stale_kv += stale
        # Highest row first: the last active row, moved into a freed one, is then never finishing itself.
        return [self._free_row(row, reason) for row, reason in reversed(finishing)]

    def _stop_reason(self, seq: _Sequence) -> FinishReason | None:
        params = seq.request.params
        if seq.token_ids[-1] in params.stop_token_ids:
            return "stop"
        if params.stop and self._ends_with_stop_string(seq):
            return "stop"
        total = len(seq.request.prompt_token_ids) + len(seq.token_ids)
        if len(seq.token_ids) >= params.max_tokens or total >= self.config.max_seq_len_tokens:
            return "length"
        return None

    def _ends_with_stop_string(self, seq: _Sequence) -> bool:
        """A new match must involve the newest token, so only a tail is decoded each step (a character
        spans at most 4 byte-level tokens); on a hit the whole completion is decoded and cut there."""
        stops = seq.request.params.stop
        window = 4 * max(len(s) for s in stops) + 4
        tail = self._tokenizer.decode(seq.token_ids[-window:], skip_special_tokens=True)
        if not any(s in tail for s in stops):
            return False
        text = self._tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            seq.stop_text = text[: min(hits)]
        return bool(hits)

    def _free_row(self, row: int, reason: FinishReason) -> Completion:
        """Finish the sequence in `row` and keep rows contiguous by moving the last active row into it."""
        seq, last = self._running[row], len(self._running) - 1
        if row != last:
            moved = self._running[last]
            self._runner.move_row(last, row, moved.num_cached)
            self._running[row] = moved
        self._running.pop()
        return self._finish(seq, reason)

    def _finish(self, seq: _Sequence, reason: FinishReason) -> Completion:
        with self._lock:
            self._in_flight.discard(seq.request.request_id)
        text = seq.stop_text
        if text is None and self._tokenizer is not None:
            text = self._tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        return Completion(
            request_id=seq.request.request_id,
            prompt_token_ids=seq.request.prompt_token_ids,
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            finish_reason=reason,
            text=text,
        )

    def _validate(self, request: SampleRequest, room_for_completion: bool = True) -> None:
        prompt, rid = request.prompt_token_ids, request.request_id
        if not prompt:
            raise ValueError(f"request {rid}: prompt_token_ids is empty")
        limit = self.config.max_seq_len_tokens - (1 if room_for_completion else 0)
        if len(prompt) > limit:
            raise ValueError(
                f"request {rid}: prompt has {len(prompt)} tokens, more than the {limit} that "
                f"max_seq_len_tokens={self.config.max_seq_len_tokens} allows; raise "
                "BuiltinEngineConfig.max_seq_len_tokens or shorten the prompt"
            )
        vocab = self._runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"request {rid}: prompt token ids must lie in [0, {vocab})")
        if request.params.stop and self._tokenizer is None:
            raise ValueError(
                f"request {rid}: stop strings need a tokenizer: BuiltinEngine(model, tokenizer=...)"
            )

    def _check_names(self, update: WeightUpdate) -> None:
        given, expected = set(update.state_dict), set(self._param_shapes)
        missing = sorted(expected - given - self._runner.optional_update_names)
        unknown = sorted(given - expected)
        if missing or unknown:
            raise ValueError(
                f"WeightUpdate v{update.version}: missing names {missing}, unknown names {unknown}"
            )
        wrong = [
            f"{name} {tuple(t.shape)} (expected {self._param_shapes[name]})"
            for name, t in update.state_dict.items()
            if tuple(t.shape) != self._param_shapes[name]
        ]
        if wrong:
            raise ValueError(f"WeightUpdate v{update.version}: wrong shapes: {wrong}")
