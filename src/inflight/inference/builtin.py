"""The built-in engine: request lifecycle (waiting -> cache row -> finished), stop conditions, per-token
versions, the LoRA adapter registry (which request uses which adapter, at which version), weight and adapter
swaps between steps and the KV policy of sequences in flight across a swap, prompt outputs (logprobs, top-k,
target ids, draws) and the top-k of generated tokens. The forward pass is a `runner.ModelRunner` (`qwen2.py`
for the families it reproduces, else `hf_runner.py`), sampling is `sampling.py`, adapter validation
`adapters.py`. One driver thread calls step()/generate(); add_request, abort, update_weights, set_adapter,
remove_adapter and metrics are thread-safe.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from inflight.inference import prompt_outputs
from inflight.inference.adapters import parse_adapter
from inflight.inference.config import BuiltinEngineConfig
from inflight.inference.prefix_cache import PrefixCache
from inflight.inference.runner import ModelRunner, build_runner
from inflight.inference.sampling import sample, topk_logprobs
from inflight.models.device import resolve_device
from inflight.types import (
    AdapterUpdate,
    Completion,
    FinishReason,
    SampleRequest,
    SamplingParams,
    WeightUpdate,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Adapter:
    """One registered adapter. Sequences hold the object itself (not the name), so a replacement reaches
    them at the next step and a removal leaves them their weights."""

    name: str
    version: int
    weights: Any  # the runner's copy; replaced (never mutated) at a step boundary
    pending: tuple[int, Any] | None = None  # (version, weights) for the next step; under the engine lock


@dataclass(frozen=True)
class _PrefillPlan:
    """The newcomers of a step as `BuiltinEngine._plan_prefill` ordered them from their first row: `leaders`
    rows to compute, resuming `cached[i]` positions already in leader i's row (0: a fresh prompt), then
    the copies as (row, its leader's row)."""

    leaders: int
    cached: list[int]
    copies: list[tuple[int, int]]


@dataclass
class _Sequence:
    request: SampleRequest
    generator: torch.Generator | None  # None: draws from the engine's generator
    adapter: _Adapter | None = None  # None: the base weights
    num_cached: int = 0  # positions whose K/V are in the cache; the last sampled token is not yet
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_text: str | None = None  # the completion text cut before the stop string that ended it
    kv_version: int = 0  # oldest weight version (the adapter's, for adapter rows) among its cached K/V
    prompt_logprobs: list[float] | None = None  # [P] when asked
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None  # [P] when asked
    target_prompt_logprobs: list[list[float]] | None = None  # [P-1][K] when asked
    prompt_alt_tokens: list[list[tuple[int, float]]] | None = None  # [P-1][k] when asked
    topk_logprobs: list[list[tuple[int, float]]] | None = None  # [T] when asked, one entry per token

    def __post_init__(self) -> None:
        if self.request.params.topk_logprobs > 0:
            self.topk_logprobs = []

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether its prefill must keep the logits of every prompt position."""
        r = self.request
        return bool(
            r.prompt_logprobs
            or r.topk_prompt_logprobs
            or r.target_prompt_ids is not None
            or r.prompt_alt_tokens_k
        )


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
    prefill_failures: int  # requests finished with an error because their own prefill raised
    adapter_updates_received: int  # set_adapter calls accepted (registrations and replacements)
    adapter_updates_applied: int  # replacements installed at a step boundary
    adapters_registered: int
    recent_updates: tuple[UpdateRecord, ...]  # the latest ones, oldest first
    # Prompt tokens not prefilled because a request admitted in the same step had the same prompt and
    # adapter (a GRPO group's samples): its K/V were copied instead.
    prompt_tokens_shared: int = 0
    # Prompt tokens not prefilled because their K/V were in the prefix cache (`prefix_cache_rows`).
    prompt_tokens_cached: int = 0
    # Requests finished with an error at admission because their own setup raised (a generator for a seed
    # torch refuses, from a caller that skipped `add_request`'s checks); the others in the step go on.
    admission_failures: int = 0

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
    prefill_failures: int = 0  # requests finished because their own prefill raised
    admission_failures: int = 0  # requests finished because their own setup (their generator) raised
    adapter_updates_received: int = 0
    adapter_updates_applied: int = 0
    prompt_tokens_shared: int = 0
    prompt_tokens_cached: int = 0


class BuiltinEngine:
    """Continuous-batching engine over a Hugging Face causal LM (weights copied onto `config.device`), with
    a LoRA adapter per request.

    Stops only where asked: add the EOS id to `SamplingParams.stop_token_ids` to stop at EOS.
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: BuiltinEngineConfig | None = None) -> None:
        self.config = config or BuiltinEngineConfig()
        self._device = resolve_device(self.config.device, key="engine.device")
        self._dtype = torch.float32 if self.config.dtype == "float32" else torch.bfloat16
        self._param_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self._runner: ModelRunner[Any, Any] = build_runner(
            model,
            self.config.runner,
            self._dtype,
            self.config.max_batch_size + self.config.prefix_cache_rows,
            self.config.max_seq_len_tokens,
            self._device,
        )
        spare = self.config.prefix_cache_rows if self._runner.resumes_cached_prefix else 0
        self._prefix_cache = PrefixCache(first_row=self.config.max_batch_size, rows=spare)
        self._tokenizer = tokenizer
        self._generator = torch.Generator(self._device).manual_seed(self.config.seed)
        self._version = 0
        self._running: list[_Sequence] = []  # index = cache row; rows 0..n-1 are exactly the active ones
        # Shared with other threads, under _lock:
        self._lock = threading.Lock()
        # Registered adapters by name; a removed one lives on in the sequences that hold it.
        self._adapters: dict[str, _Adapter] = {}
        self._waiting: deque[tuple[SampleRequest, _Adapter | None]] = deque()
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

    @property
    def device(self) -> torch.device:
        return self._device

    def lora_modules(self) -> list[str] | None:
        """Adapters may adapt any linear layer of the model, the LM head included."""
        return None

    def adapters(self) -> dict[str, int]:
        """Registered adapter name -> the version new requests get (a pending replacement's, if any)."""
        with self._lock:
            return {n: (a.pending[0] if a.pending else a.version) for n, a in self._adapters.items()}

    def add_request(self, request: SampleRequest) -> None:
        self._validate(request)
        with self._lock:
            if request.request_id in self._in_flight:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            adapter = self._lookup_adapter(request)  # again under the lock: a removal may have come between
            self._in_flight.add(request.request_id)
            self._waiting.append((request, adapter))

    def set_adapter(self, update: AdapterUpdate) -> None:
        """Register the adapter `update.name`, or replace its weights. Validated and copied now, in the
        caller's thread (ValueError naming the module at fault); a new name serves requests at once, a
        replacement is installed between two decode steps, and the requests in flight on it continue on
        the new weights from that step on, their tokens stamped with `update.version`. Latest call wins."""
        modules = parse_adapter(update, self._runner.lora_shapes)
        with torch.inference_mode():
            weights = self._runner.snapshot_adapter(modules, update.scale)
        with self._lock:
            self._counters.adapter_updates_received += 1
            adapter = self._adapters.get(update.name)
            if adapter is None:  # no sequence holds it yet, so it may take effect mid-step
                self._adapters[update.name] = _Adapter(update.name, update.version, weights)
            else:
                adapter.pending = (update.version, weights)

    def remove_adapter(self, name: str) -> None:
        """Unregister `name`: requests naming it are refused from now on (ValueError); requests already
        added with it, waiting or running, finish on the weights it had when removed (a replacement still
        pending is dropped). ValueError if no adapter has that name."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise ValueError(
                    f"remove_adapter: no adapter named {name!r} (registered: {sorted(self._adapters)})"
                )
            adapter.pending = None

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
                adapters_registered=len(self._adapters),
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
            token_ids, logprobs, failed = self._execute(num_new)
            finished += failed
            if self._running:
                finished += self._update(token_ids, logprobs)
        if self._running or finished:
            with self._lock:
                self._counters.busy_s += time.perf_counter() - start
        return finished

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], adapter: str | None = None) -> list[float]:
        """[T] log p(token_t | tokens_<t) at temperature 1, current weights (and `adapter`'s); [0] is NaN."""
        request = SampleRequest(prompt_token_ids=token_ids, adapter=adapter)
        self._validate(request, room_for_completion=False)
        with self._lock:
            entry = self._lookup_adapter(request)
        logits = self._runner.full_logits(token_ids, None if entry is None else entry.weights)
        return prompt_outputs.prompt_logprobs(token_ids, torch.log_softmax(logits[:-1].float(), dim=-1), 0)[0]

    def _lookup_adapter(self, request: SampleRequest) -> _Adapter | None:
        """The adapter a request names (None: the base weights); the caller holds the lock."""
        if request.adapter is None:
            return None
        adapter = self._adapters.get(request.adapter)
        if adapter is None:
            raise ValueError(
                f"request {request.request_id}: no adapter named {request.adapter!r} is registered "
                f"(registered: {sorted(self._adapters)}); register it with "
                "set_adapter(AdapterUpdate(name=..., ...)) first, or leave adapter=None for the base model"
            )
        return adapter

    def _schedule(self) -> tuple[list[Completion], int]:
        """Apply aborts and pending updates, then admit waiting requests into free rows (appended last); one
        whose own setup fails is finished with its error instead. Returns (finished, number admitted)."""
        with self._lock:
            pending, self._pending = self._pending, None
            adapter_updates = [(a, a.pending) for a in self._adapters.values() if a.pending is not None]
            for adapter, _ in adapter_updates:
                adapter.pending = None
            aborts, self._aborts = self._aborts, set()
            aborted = [w for w in self._waiting if w[0].request_id in aborts]
            for waiting in aborted:
                self._waiting.remove(waiting)
            free = self.config.max_batch_size - len(self._running)
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        finished = [self._finish(_Sequence(r, None), "abort") for r, _ in aborted]
        for request_id in aborts:
            row = next((i for i, s in enumerate(self._running) if s.request.request_id == request_id), None)
            if row is not None:
                finished.append(self._free_row(row, "abort"))
        # After the aborts: their rows need no recompute.
        changed: set[_Adapter] = set()
        for adapter, (version, weights) in adapter_updates:
            adapter.version, adapter.weights = version, weights
            changed.add(adapter)
        if changed:
            with self._lock:
                self._counters.adapter_updates_applied += len(changed)
        if pending is not None:
            self._install(*pending)
        elif changed and self.config.kv_policy == "recompute":
            self._recompute_cache([i for i, s in enumerate(self._running) if s.adapter in changed])
        num_new = 0
        for request, entry in admitted:
            try:
                sequence = self._admit(request, entry)
            except Exception as exc:  # fault boundary: its own setup fails this request, not the step
                error = _describe(exc)
                log.warning("request %s failed at admission: %s", request.request_id, error)
                finished.append(self._finish(_Sequence(request, None), "abort", error=error))
                with self._lock:
                    self._counters.admission_failures += 1
                continue
            self._running.append(sequence)
            num_new += 1
        return finished, num_new

    def _admit(self, request: SampleRequest, entry: _Adapter | None) -> _Sequence:
        """A waiting request as a running sequence, with the generator its seed asks for."""
        seed = request.params.seed
        generator = None if seed is None else torch.Generator(self._device).manual_seed(seed)
        sequence = _Sequence(request, generator, entry)
        sequence.kv_version = self._weights_version(sequence)
        return sequence

    def _weights_version(self, seq: _Sequence) -> int:
        """The version a sequence's tokens are stamped with now: its adapter's, else the base weights'.
        (LoRA training keeps the base frozen, so an adapter's version is its policy version.)"""
        return self._version if seq.adapter is None else seq.adapter.version

    def _install(self, version: int, weights: Any, copy_s: float) -> None:
        """Swap weights between two decode steps (a step never mixes two versions), then apply the KV
        policy to the sequences in flight (with "recompute", all of them: the base changed under each)."""
        start = time.perf_counter()
        self._runner.install(weights)
        self._version = version
        recomputed = 0
        if self.config.kv_policy == "recompute" and self._running:
            recomputed = self._recompute_cache(list(range(len(self._running))))
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

    def _recompute_cache(self, rows: list[int]) -> int:
        """Re-prefill these running rows' cached prefixes with the current weights; returns positions redone.

        A row caches prompt + generated tokens except the newest one (decode feeds that one next step).
        """
        prefixes = {
            r: (s.request.prompt_token_ids + s.token_ids)[: s.num_cached] for r, s in self._enumerate(rows)
        }
        i = 0
        while i < len(rows):
            # Consecutive rows while the padded chunk (rows x longest prefix) fits the token budget.
            j, longest = i + 1, len(prefixes[rows[i]])
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                longest_next = max(longest, len(prefixes[rows[j]]))
                if (j + 1 - i) * longest_next > self.config.recompute_chunk_tokens:
                    break
                j, longest = j + 1, longest_next
            chunk = rows[i:j]
            self._runner.fill_cache(
                [prefixes[r] for r in chunk],
                row0=chunk[0],
                adapters=[self._adapter_weights(r) for r in chunk],
            )
            i = j
        for _, seq in self._enumerate(rows):
            seq.kv_version = self._weights_version(seq)
        return sum(len(p) for p in prefixes.values())

    def _enumerate(self, rows: list[int]) -> list[tuple[int, _Sequence]]:
        return [(r, self._running[r]) for r in rows]

    def _adapter_weights(self, row: int) -> Any:
        adapter = self._running[row].adapter
        return None if adapter is None else adapter.weights

    def _execute(self, num_new: int) -> tuple[Tensor, Tensor, list[Completion]]:
        """Decode one token for rows admitted earlier, prefill the newcomers (their prompt logprobs from the
        same pass), sample for all rows. Decode and prefill are one forward pass where they can be
        (`_merges_decode_and_prefill`). Newcomers whose own prefill fails are finished with the error
        (returned third) and leave their rows; the others go on as if they had been alone."""
        num_old = len(self._running) - num_new
        old = self._running[:num_old]
        adapters = [self._adapter_weights(row) for row in range(len(self._running))]
        # Logits [k, V] of consecutive rows, in row order: the decode's as they come (a step without
        # newcomers samples from them uncopied), then the newcomers'.
        blocks: list[Tensor] = []
        if old and num_new and self._merges_decode_and_prefill(num_old):
            try:
                blocks.append(self._decode_and_prefill(num_old, adapters))
            except Exception:  # a newcomer's prefill, most likely: apart below, where only its cause fails
                log.debug("the one-pass decode and prefill raised; running them apart", exc_info=True)
            else:
                old, num_new = [], 0  # all done
        if old:
            tokens = [s.token_ids[-1] for s in old]
            positions = [s.num_cached for s in old]
            blocks.append(self._runner.decode(tokens, positions, adapters[:num_old]))
            for s in old:
                s.num_cached += 1
        failed: list[tuple[int, str]] = []
        if num_new:
            try:
                blocks.append(torch.stack(self._prefill(num_old, len(self._running), adapters)))
            except Exception as exc:  # fault boundary: retried one by one, so only its cause fails
                if num_new == 1:
                    failed.append((num_old, _describe(exc)))
                else:
                    for row in range(num_old, len(self._running)):
                        try:
                            blocks.append(torch.stack(self._prefill(row, row + 1, adapters)))
                        except Exception as one:
                            failed.append((row, _describe(one)))
        finished = []
        if failed:  # one [V] row each, a placeholder for a failed one, removed with its row below
            present, failed_rows = iter(torch.cat(blocks) if blocks else ()), {row for row, _ in failed}
            rows = [torch.empty(0) if r in failed_rows else next(present) for r in range(len(self._running))]
            for row, error in reversed(failed):  # highest first: the moved last row is never a failed one
                log.warning("request %s failed in prefill: %s", self._running[row].request.request_id, error)
                last = len(self._running) - 1
                rows[row] = rows[last]
                rows.pop()
                finished.append(self._free_row(row, "abort", error=error))
            blocks = [torch.stack(rows)] if rows else []
            with self._lock:
                self._counters.prefill_failures += len(failed)
        if not self._running:
            return torch.empty(0), torch.empty(0), finished
        logits = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        params = [s.request.params for s in self._running]
        token_ids, logprobs = sample(logits, params, [s.generator for s in self._running], self._generator)
        self._record_topk(logits, params)
        return token_ids, logprobs, finished

    def _record_topk(self, logits: Tensor, params: list[SamplingParams]) -> None:
        """Append this step's top-k (id, logprob) to each running sequence that asks for them; tokens the
        row's distribution cannot draw (-inf) are left out."""
        rows, ids, values = topk_logprobs(logits, params)
        if not rows:
            return
        for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            seq, k = self._running[row], params[row].topk_logprobs
            pairs = [(i, v) for i, v in zip(row_ids[:k], row_values[:k], strict=True) if v != -math.inf]
            assert seq.topk_logprobs is not None  # set at admission for requests that ask
            seq.topk_logprobs.append(pairs)

    def _merges_decode_and_prefill(self, num_old: int) -> bool:
        """Whether this step's decode and its newcomers' prefill can run as one pass: the runner resumes
        cached prefixes (`decode_and_prefill`), and no newcomer wants its prompt's outputs (those come from a
        whole prefill of its own)."""
        return self._runner.resumes_cached_prefix and not any(
            s.wants_prompt_logits for s in self._running[num_old:]
        )

    def _decode_and_prefill(self, num_old: int, adapters: list[Any]) -> Tensor:
        """Logits [rows, V] of one pass (`ModelRunner.decode_and_prefill`): a token for each of rows
        0..num_old-1, and the newcomers after them prefilled as `_prefill` does (leaders computed, resuming
        a cached prefix where there is one; copies given their leader's K/V and logits)."""
        old = self._running[:num_old]
        plan = self._plan_prefill(num_old, len(self._running), adapters)
        leaders = self._running[num_old : num_old + plan.leaders]
        prompts = [s.request.prompt_token_ids for s in leaders]
        logits = self._runner.decode_and_prefill(
            [s.token_ids[-1] for s in old],
            [s.num_cached for s in old],
            prompts,
            plan.cached,
            adapters[: num_old + plan.leaders],
        )
        for s in old:
            s.num_cached += 1
        for s, prompt in zip(leaders, prompts, strict=True):
            s.num_cached = len(prompt)
        self._count_cached(plan.cached)
        copied = self._copy_leaders(plan)
        if not copied:
            return logits
        return torch.cat([logits, logits[torch.tensor(copied, device=logits.device)]])

    def _prefill(self, row0: int, row1: int, adapters: list[Any]) -> list[Tensor]:
        """Prefill the newcomers in rows row0..row1-1 (`_plan_prefill`); their last-position logits, one [V]
        per row."""
        plan = self._plan_prefill(row0, row1, adapters)
        resumed = sum(1 for c in plan.cached if c)
        last = self._prefill_cached(row0, plan.cached[:resumed], adapters)
        if plan.leaders > resumed:
            last += self._prefill_rows(row0 + resumed, row0 + plan.leaders, adapters)
        return last + [last[leader - row0] for leader in self._copy_leaders(plan)]

    def _plan_prefill(self, row0: int, row1: int, adapters: list[Any]) -> _PrefillPlan:
        """Order the newcomers in rows row0..row1-1 (in `self._running` and `adapters` alike) for their
        prefill, and copy in the cached prefixes they resume.

        Newcomers with the same prompt and adapter (a GRPO group's samples, admitted together) are
        prefilled once: the first of each prompt (its leader) comes first, and the others (copies) come
        last, to get a copy of its K/V and its logits. Requests that ask for prompt outputs are prefilled
        on their own. A leader whose prompt begins with a prefix in the prefix cache gets that prefix's K/V
        copied into its row (leaders with one come first) and prefills only the rest."""
        new = self._running[row0:row1]
        first: dict[tuple, int] = {}
        leaders: list[int] = []
        copies: list[tuple[int, int]] = []  # (index in new, index of its leader in new)
        for i, s in enumerate(new):
            alone = i if s.wants_prompt_logits else -1  # prompt outputs come from a request's own pass
            key = (tuple(s.request.prompt_token_ids), id(adapters[row0 + i]), alone)
            leader = first.setdefault(key, i)
            if leader == i:
                leaders.append(i)
            else:
                copies.append((i, leader))
        hits = {i: hit for i in leaders if (hit := self._cached_prefix(new[i])) is not None}
        order = [i for i in leaders if i in hits] + [i for i in leaders if i not in hits]
        order += [i for i, _ in copies]
        self._running[row0:row1] = [new[i] for i in order]
        adapters[row0:row1] = [adapters[row0 + i] for i in order]
        row_of = {i: row0 + k for k, i in enumerate(order)}
        for i in order[: len(hits)]:
            spare, length = hits[i]
            self._runner.move_row(spare, row_of[i], length)
        return _PrefillPlan(
            leaders=len(leaders),
            cached=[hits[i][1] if i in hits else 0 for i in order[: len(leaders)]],
            copies=[(row_of[i], row_of[leader]) for i, leader in copies],
        )

    def _copy_leaders(self, plan: _PrefillPlan) -> list[int]:
        """Each copy's row gets its leader's K/V (the leaders' prefill done); returns each copy's leader
        row, in the copies' row order."""
        for row, leader in plan.copies:
            length = len(self._running[row].request.prompt_token_ids)
            self._runner.move_row(leader, row, length)
            self._running[row].num_cached = length
        if plan.copies:
            with self._lock:
                self._counters.prompt_tokens_shared += sum(
                    len(self._running[row].request.prompt_token_ids) for row, _ in plan.copies
                )
        return [leader for _, leader in plan.copies]

    def _cached_prefix(self, seq: _Sequence) -> tuple[int, int] | None:
        """(spare row, length) of the longest cached prefix of its prompt, or None (prompt outputs come
        from a whole prefill: never resumed)."""
        if not self._prefix_cache.rows or seq.wants_prompt_logits:
            return None
        return self._prefix_cache.lookup(
            seq.request.prompt_token_ids, seq.adapter, self._weights_version(seq)
        )

    def _prefill_cached(self, row0: int, cached: list[int], adapters: list[Any]) -> list[Tensor]:
        """Rows row0.., the K/V of the first cached[i] positions of row row0 + i's prompt in place: prefill
        only the rest."""
        if not cached:
            return []
        seqs = self._running[row0 : row0 + len(cached)]
        prompts = [s.request.prompt_token_ids for s in seqs]
        last = self._runner.prefill_after(prompts, cached, row0, adapters[row0 : row0 + len(cached)])
        for s, prompt in zip(seqs, prompts, strict=True):
            s.num_cached = len(prompt)
        self._count_cached(cached)
        return list(last)

    def _count_cached(self, cached: list[int]) -> None:
        """Prompt positions a finished pass took from the prefix cache (counted once it succeeded: a step
        whose one pass raised plans its newcomers again)."""
        with self._lock:
            self._counters.prompt_tokens_cached += sum(cached)

    def _prefill_rows(self, row0: int, row1: int, adapters: list[Any]) -> list[Tensor]:
        new = self._running[row0:row1]
        wanted = [i for i, s in enumerate(new) if s.wants_prompt_logits]
        last, full = self._runner.prefill(
            [s.request.prompt_token_ids for s in new], row0, adapters[row0:row1], wanted
        )
        for i, s in enumerate(new):
            s.num_cached = len(s.request.prompt_token_ids)
            if i in full:
                self._prompt_outputs(s, full[i])
        return list(last)

    def _prompt_outputs(self, seq: _Sequence, logits: Tensor) -> None:
        """Everything a request asks of its prompt, from the logits [P, V] of its prefill."""
        r = seq.request
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # [P-1, V]: predictions for prompt[1:]
        lps, topk = prompt_outputs.prompt_logprobs(r.prompt_token_ids, logprobs, r.topk_prompt_logprobs)
        seq.prompt_logprobs = lps if r.prompt_logprobs else None
        seq.topk_prompt_logprobs = topk if r.topk_prompt_logprobs else None
        if r.target_prompt_ids is not None:
            seq.target_prompt_logprobs = prompt_outputs.target_logprobs(logprobs, r.target_prompt_ids)
        if r.prompt_alt_tokens_k:
            seed = r.params.seed
            # A generator of its own, so the request's sampled tokens do not depend on the draws.
            generator = self._generator if seed is None else torch.Generator(self._device).manual_seed(seed)
            seq.prompt_alt_tokens = prompt_outputs.alt_tokens(
                logits[:-1].float(), logprobs, r.prompt_alt_tokens_k, r.params.temperature, generator
            )

    def _update(self, token_ids: Tensor, logprobs: Tensor) -> list[Completion]:
        finishing: list[tuple[int, FinishReason, str | None]] = []
        stale = 0
        # The step's one copy to the host: tokens (exact in float64) and logprobs together.
        host_tokens, host_logprobs = torch.stack((token_ids.double(), logprobs.double())).tolist()
        rows = zip(self._running, host_tokens, host_logprobs, strict=True)
        for row, (seq, token, logprob) in enumerate(rows):
            version = self._weights_version(seq)
            if math.isnan(logprob):  # a NaN or infinite logit in the row (see `_non_finite`): no token
                finishing.append((row, "abort", self._non_finite(seq, version)))
                continue
            seq.token_ids.append(int(token))
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            stale += seq.kv_version < version
            reason = self._stop_reason(seq)
            if reason is not None:
                finishing.append((row, reason, None))
        with self._lock:
            self._counters.tokens_generated += len(self._running)
            self._counters.tokens_on_stale_kv += stale
        # Highest row first: the last active row, moved into a freed one, is then never finishing itself.
        finished = []
        for row, reason, error in reversed(finishing):
            if error is not None:  # non-finite: no NaN may stay in the row for its next occupant
                self._runner.clear_row(row)
            finished.append(self._free_row(row, reason, error))
        return finished

    def _non_finite(self, seq: _Sequence, version: int) -> str:
        """The error of a row whose logits hold a NaN or an infinity. Every sampled logprob is finite
        otherwise, and any such logit makes it NaN (softmax and logsumexp propagate it), so the check
        costs nothing on the device. Only this request fails: other rows, other adapters and the engine
        go on."""
        log.warning("request %s: non-finite logits", seq.request.request_id)
        weights = "the base weights" if seq.adapter is None else f"adapter {seq.adapter.name!r}"
        return (
            f"the logits are not finite (NaN or infinity) under {weights} at version {version}: those "
            "weights have diverged; sample from an earlier checkpoint, and train with a lower learning rate"
        )

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

    def _free_row(self, row: int, reason: FinishReason, error: str | None = None) -> Completion:
        """Finish the sequence in `row` and keep rows contiguous by moving the last active row into it."""
        seq, last = self._running[row], len(self._running) - 1
        if reason != "abort" and error is None:
            self._retain(row, seq)
        if row != last:
            moved = self._running[last]
            self._runner.move_row(last, row, moved.num_cached)
            self._running[row] = moved
        self._running.pop()
        return self._finish(seq, reason, error)

    def _retain(self, row: int, seq: _Sequence) -> None:
        """Keep a finished sequence's K/V in the prefix cache (all of it computed by the current weights)."""
        version = self._weights_version(seq)
        if not self._prefix_cache.rows or seq.kv_version != version or not seq.num_cached:
            return
        tokens = (seq.request.prompt_token_ids + seq.token_ids)[: seq.num_cached]
        spare = self._prefix_cache.retain(tokens, seq.adapter, version)
        if spare is not None:
            self._runner.move_row(row, spare, len(tokens))

    def _finish(self, seq: _Sequence, reason: FinishReason, error: str | None = None) -> Completion:
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
            prompt_logprobs=seq.prompt_logprobs,
            topk_prompt_logprobs=seq.topk_prompt_logprobs,
            topk_logprobs=seq.topk_logprobs,
            target_prompt_logprobs=seq.target_prompt_logprobs,
            prompt_alt_tokens=seq.prompt_alt_tokens,
            error=error,
        )

    def _validate(self, request: SampleRequest, room_for_completion: bool = True) -> None:
        prompt, rid = request.prompt_token_ids, request.request_id
        if not prompt:
            raise ValueError(f"request {rid}: prompt_token_ids is empty")
        limit = self.config.max_seq_len_tokens - (1 if room_for_completion else 0)
        if len(prompt) > limit:
            raise ValueError(
                f"request {rid}: prompt has {len(prompt)} tokens, more than the {limit} that "
                f"max_seq_len_tokens={self.config.max_seq_len_tokens} allows; shorten the prompt or raise "
                "the limit (`inflight run`: engine.max_seq_len_tokens=N; `inflight serve-engine`: "
                "--max-seq-len-tokens N)"
            )
        vocab = self._runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"request {rid}: prompt token ids must lie in [0, {vocab})")
        self._validate_params(request.params, rid, vocab)
        if request.params.stop and self._tokenizer is None:
            raise ValueError(
                f"request {rid}: stop strings need a tokenizer: BuiltinEngine(model, tokenizer=...)"
            )
        if request.params.logprobs_kind not in ("sampled", "raw"):
            raise ValueError(
                f"request {rid}: logprobs_kind must be 'sampled' or 'raw', "
                f"got {request.params.logprobs_kind!r}"
            )
        if request.topk_prompt_logprobs < 0:
            raise ValueError(
                f"request {rid}: topk_prompt_logprobs must be >= 0, got {request.topk_prompt_logprobs}"
            )
        if request.prompt_alt_tokens_k < 0:
            raise ValueError(
                f"request {rid}: prompt_alt_tokens_k must be >= 0, got {request.prompt_alt_tokens_k}"
            )
        targets = request.target_prompt_ids
        if targets is not None:
            if len(targets) != len(prompt) - 1:
                raise ValueError(
                    f"request {rid}: target_prompt_ids has {len(targets)} rows; it needs len(prompt) - 1 = "
                    f"{len(prompt) - 1} (row i scores prompt position i + 1)"
                )
            bad = [t for row in targets for t in row if not -1 <= t < vocab]
            if bad:
                raise ValueError(
                    f"request {rid}: target_prompt_ids holds {bad[0]}; ids must lie in [0, {vocab}), or be -1"
                )
        with self._lock:
            self._lookup_adapter(request)

    @staticmethod
    def _validate_params(params: SamplingParams, rid: str, vocab: int) -> None:
        """What SamplingParams lets through and the step cannot take: checked here, so that a request fails
        at submission, never in the step that the other requests share."""
        if not math.isfinite(params.temperature):
            raise ValueError(
                f"request {rid}: temperature must be a finite number >= 0, got {params.temperature}"
            )
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise ValueError(
                f"request {rid}: seed must lie in [-2**63, 2**64) (a torch generator's), got {params.seed}"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid}: stop_token_ids holds {bad[0]}; ids must lie in [0, {vocab})")

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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
