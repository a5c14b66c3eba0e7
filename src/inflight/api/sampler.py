"""The service's sampling: Tinker sample jobs through the shared engine, one `EngineLoop` per base model.

Owns the mapping between Tinker's sampling semantics and engine requests (a job's `num_samples` become that
many requests, sample i seeded `seed + i`; no stop given means stop at EOS; logprobs, top-k ones included,
are the raw model's, temperature 1 untruncated, asked of the engine explicitly; the prompt's outputs are the
first request's) and the sampler weights the engine holds (LoRA
adapters registered under sampler keys). Knows nothing of HTTP, futures in the database, or training: the
worker submits jobs and gets a `concurrent.futures.Future` per job, settled on the engine loop's thread when
its last sequence finishes, so a long sample never holds up anyone's training.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from inflight.api.job_types import SampledSequence, SampleJob, SampleOutput, TargetLogprobs
from inflight.errors import UserError
from inflight.inference.builtin import BuiltinEngine
from inflight.inference.engine_loop import EngineLoop
from inflight.types import AdapterUpdate, Completion, SampleRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingLimits:
    """What a sample job of one base model must fit in."""

    vocab_size: int
    max_context: int  # tokens: prompt + generated
    eos_ids: tuple[int, ...]  # Tinker: no stop given = stop at EOS


class SamplingLoop(Protocol):
    """What the sampler drives per base model: an `EngineLoop` over the built-in engine in this process, or
    an `HttpEngine` on a `serve-engine` process (`inflight serve --engine vllm`). Thread-safe."""

    def start(self) -> object: ...

    def stop(self) -> None: ...

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[Completion]: ...

    def abort(self, request_id: str) -> None: ...

    def set_adapter(self, update: AdapterUpdate) -> None: ...

    def remove_adapter(self, name: str) -> None: ...


def build_sampler(engines: Mapping[str, tuple[BuiltinEngine, SamplingLimits]]) -> Sampler:
    """A loop per base model's engine (started by `Sampler.start`)."""
    loops: dict[str, SamplingLoop] = {name: EngineLoop(engine) for name, (engine, _) in engines.items()}
    return Sampler(loops, {name: limits for name, (_, limits) in engines.items()})


class Sampler:
    """`submit(job) -> Future[SampleOutput]` from the worker's thread; adapters set and removed from it too.

    The engine loops run on their own threads; a job's future resolves on the loop thread that finished its
    last sequence (callers hand it back to their own thread, e.g. with a queue).
    """

    def __init__(self, loops: Mapping[str, SamplingLoop], limits: Mapping[str, SamplingLimits]) -> None:
        self._loops = dict(loops)
        self._limits = dict(limits)
        self._adapters: dict[str, str] = {}  # sampler key -> its base model
        # Jobs submitted under a key and not yet settled, so `cancel(key)` can abort their engine requests.
        self._jobs: dict[str, _Gather] = {}
        self._jobs_lock = threading.Lock()  # cancel comes from route threads, settling from loop threads

    def start(self) -> Sampler:
        for loop in self._loops.values():
            loop.start()
        return self

    def stop(self) -> None:
        """Abort what is in flight (those futures fail) and stop every loop."""
        for loop in self._loops.values():
            loop.stop()

    def has_adapter(self, key: str) -> bool:
        return key in self._adapters

    def base_model_of(self, key: str) -> str | None:
        return self._adapters.get(key)

    def set_adapter(self, base_model: str, update: AdapterUpdate) -> None:
        """Register (or replace) sampler weights under `update.name`; requests already running on that key
        go on with the new weights from the engine's next step (their tokens say which version)."""
        owner = self._adapters.get(update.name)
        if owner is not None and owner != base_model:
            raise UserError(f"sampler weights {update.name!r} already belong to base model {owner!r}")
        try:
            self._loop(base_model).set_adapter(update)
        except ValueError as exc:  # the engine refused the weights themselves (e.g. NaN): the user's to fix
            raise UserError(f"sampler weights {update.name!r}: {exc}") from exc
        self._adapters[update.name] = base_model

    def remove_adapter(self, key: str) -> None:
        """Forget sampler weights (idempotent); samples already running on them finish on them."""
        base_model = self._adapters.pop(key, None)
        if base_model is not None:
            self._loops[base_model].remove_adapter(key)

    def cancel(self, key: str) -> bool:
        """Abort the job submitted under `key` (any thread): its future fails with SampleCancelledError at
        once and the engine drops its sequences at its next step, freeing their rows. False if no such
        job is in flight (never submitted, or already settled)."""
        with self._jobs_lock:
            gather = self._jobs.pop(key, None)
        if gather is None:
            return False
        gather.cancel()
        return True

    def submit(self, job: SampleJob, key: str | None = None) -> concurrent.futures.Future[SampleOutput]:
        """Validate `job` and queue its sequences; a bad job raises UserError here, before anything runs.

        A `key` (the worker uses the future's request id) lets `cancel(key)` abort the job later."""
        loop = self._loop(job.base_model)
        if job.weights is not None:
            owner = self._adapters.get(job.weights)
            if owner is None:
                raise UserError(f"unknown sampling weights {job.weights!r} (no model or sampler checkpoint)")
            if owner != job.base_model:
                raise UserError(
                    f"sampling weights {job.weights!r} belong to base model {owner!r}, not {job.base_model!r}"
                )
        requests = engine_requests(job, self._limits[job.base_model])
        out: concurrent.futures.Future[SampleOutput] = concurrent.futures.Future()
        gather = _Gather(job, out, requests, loop)
        submitted: list[str] = []
        try:
            for i, request in enumerate(requests):
                loop.submit(request).add_done_callback(functools.partial(gather.done, i))
                submitted.append(request.request_id)
        except ValueError as exc:  # the engine's own check refused it: the job's fault, nothing else
            for request_id in submitted:
                loop.abort(request_id)
            raise UserError(f"sample: {exc}") from exc
        if key is not None:
            with self._jobs_lock:
                self._jobs[key] = gather
            out.add_done_callback(functools.partial(self._forget, key, gather))
        return out

    def _forget(self, key: str, gather: _Gather, _: concurrent.futures.Future[SampleOutput]) -> None:
        with self._jobs_lock:
            if self._jobs.get(key) is gather:
                del self._jobs[key]

    def _loop(self, base_model: str) -> SamplingLoop:
        if base_model not in self._loops:
            raise UserError(f"unknown base model {base_model!r}; this server has: {', '.join(self._loops)}")
        return self._loops[base_model]


class SampleCancelledError(RuntimeError):
    """The job was cancelled (`Sampler.cancel`); whoever cancelled it has recorded that already."""


class _Gather:
    """Collects one job's completions (from any loop thread) and settles its future once, in order."""

    def __init__(
        self,
        job: SampleJob,
        out: concurrent.futures.Future[SampleOutput],
        requests: Sequence[SampleRequest],
        loop: SamplingLoop,
    ) -> None:
        self._job = job
        self._out = out
        self._request_ids = [r.request_id for r in requests]
        self._loop = loop
        self._results: list[Completion | None] = [None] * len(requests)
        self._left = len(requests)
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Fail the job now and abort every one of its engine requests (the engine frees their rows)."""
        with self._lock:
            if self._out.done():
                return
            self._out.set_exception(SampleCancelledError("sample cancelled"))
        for request_id in self._request_ids:
            self._loop.abort(request_id)

    def done(self, i: int, future: concurrent.futures.Future[Completion]) -> None:
        error = future.exception() if not future.cancelled() else RuntimeError("sample request cancelled")
        if isinstance(error, ValueError):  # a remote engine refused the request itself: the job's fault
            error = UserError(f"sample: {error}")
        with self._lock:
            if self._out.done():
                return
            if error is None:
                completion = future.result()
                if completion.finish_reason == "abort":
                    error = RuntimeError("the engine aborted the sample (the server is stopping)")
                else:
                    self._results[i] = completion
                    self._left -= 1
        try:
            if error is not None:
                self._out.set_exception(error)
                for request_id in self._request_ids:  # the job failed: its other sequences are wasted work
                    self._loop.abort(request_id)
            elif self._left == 0:
                self._out.set_result(sample_output(self._job, [c for c in self._results if c is not None]))
        except concurrent.futures.InvalidStateError:  # settled by a concurrent callback
            pass
        except Exception as exc:  # encoding this job failed: its own failure, reported on its future
            log.exception("building the sample output failed")
            self._out.set_exception(exc)


def engine_requests(job: SampleJob, limits: SamplingLimits) -> list[SampleRequest]:
    """The job's sequences as engine requests; every problem is a UserError naming it."""
    prompt = job.prompt_tokens
    if not prompt:
        raise UserError("sample: the prompt has no tokens")
    bad = [i for i, t in enumerate(prompt) if not isinstance(t, int) or not 0 <= t < limits.vocab_size]
    if bad:
        token, vocab = prompt[bad[0]], limits.vocab_size
        raise UserError(f"sample: prompt token {bad[0]} = {token!r} is not a token id in [0, {vocab})")
    if len(prompt) >= limits.max_context:
        raise UserError(
            f"sample: the prompt has {len(prompt)} tokens, leaving no room to generate within the "
            f"model's context of {limits.max_context}"
        )
    if job.max_tokens < 1:
        raise UserError(f"sample: max_tokens must be >= 1, got {job.max_tokens}")
    if job.num_samples < 1:
        raise UserError(f"sample: num_samples must be >= 1, got {job.num_samples}")
    if job.top_k < -1:
        raise UserError(f"sample: top_k must be -1 (off) or >= 1, got {job.top_k}")
    widths = {
        "topk_prompt_logprobs": job.topk_prompt_logprobs,
        "topk_sample_logprobs": job.topk_sample_logprobs,
        "prompt_alt_tokens_k": job.prompt_alt_tokens_k,
    }
    for name, k in widths.items():
        if k < 0:
            raise UserError(f"sample: {name} must be >= 0, got {k}")
    stop_ids, stop_strings = _stops(job.stop, limits.vocab_size, limits.eos_ids)
    requests = []
    for i in range(job.num_samples):
        try:
            params = SamplingParams(
                # Generation also ends at the context limit (stop reason "length").
                max_tokens=min(job.max_tokens, limits.max_context - len(prompt)),
                temperature=job.temperature,
                top_p=job.top_p,
                top_k=max(job.top_k, 0),
                seed=None if job.seed is None else job.seed + i,
                stop=stop_strings,
                stop_token_ids=stop_ids,
                logprobs_kind="raw",  # Tinker's: the model's own distribution at temperature 1
                topk_logprobs=job.topk_sample_logprobs,
            )
        except ValueError as exc:
            raise UserError(f"sample: {exc}") from exc
        requests.append(
            SampleRequest(
                prompt_token_ids=list(prompt),
                params=params,
                adapter=job.weights,
                # The prompt's outputs are the same for every sample: the first one computes them (its
                # draws seeded with the job's seed).
                prompt_logprobs=i == 0 and job.prompt_logprobs,
                topk_prompt_logprobs=job.topk_prompt_logprobs if i == 0 else 0,
                target_prompt_ids=job.target_prompt.ids if i == 0 and job.target_prompt else None,
                prompt_alt_tokens_k=job.prompt_alt_tokens_k if i == 0 else 0,
            )
        )
    return requests


def sample_output(job: SampleJob, completions: Sequence[Completion]) -> SampleOutput:
    """Tinker's view of a job's completions: prompt logprobs with None (not NaN) at position 0; every output
    asked for is there, or this raises (an engine bug, never a silently shorter answer)."""
    first = completions[0]
    prompt_lps: list[float | None] | None = None
    if job.prompt_logprobs:
        if first.prompt_logprobs is None:
            raise RuntimeError("engine bug: prompt logprobs were asked for and not returned")
        prompt_lps = [None, *first.prompt_logprobs[1:]]
    topk: list[list[tuple[int, float]] | None] | None = None
    if job.topk_prompt_logprobs > 0:
        if first.topk_prompt_logprobs is None:
            raise RuntimeError("engine bug: top-k prompt logprobs were asked for and not returned")
        topk = [None, *first.topk_prompt_logprobs[1:]]
    targets = None
    if job.target_prompt is not None:
        if first.target_prompt_logprobs is None:
            raise RuntimeError("engine bug: target prompt logprobs were asked for and not returned")
        targets = TargetLogprobs(first.target_prompt_logprobs, job.target_prompt.layout)
    if job.prompt_alt_tokens_k and first.prompt_alt_tokens is None:
        raise RuntimeError("engine bug: prompt alternative tokens were asked for and not returned")
    if job.topk_sample_logprobs and any(c.topk_logprobs is None for c in completions):
        raise RuntimeError("engine bug: top-k sample logprobs were asked for and not returned")
    return SampleOutput(
        sequences=[
            SampledSequence(
                tokens=list(c.token_ids),
                logprobs=list(c.logprobs),
                stop_reason="stop" if c.finish_reason == "stop" else "length",
                topk_logprobs=c.topk_logprobs if job.topk_sample_logprobs else None,
            )
            for c in completions
        ],
        prompt_logprobs=prompt_lps,
        topk_prompt_logprobs=topk,
        target_prompt_logprobs=targets,
        prompt_alt_tokens=first.prompt_alt_tokens if job.prompt_alt_tokens_k else None,
    )


def _stops(
    stop: Sequence[str] | Sequence[int] | str | None, vocab_size: int, eos_ids: Sequence[int]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if stop is None:  # Tinker: no stop given = stop at EOS; [] = never stop, not even at EOS
        return tuple(sorted(eos_ids)), ()
    if isinstance(stop, str):
        stop = [stop]
    if all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise UserError("sample: stop strings must be non-empty")
        return (), tuple(str(s) for s in stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        bad = [s for s in stop if not 0 <= int(s) < vocab_size]
        if bad:
            raise UserError(f"sample: stop token ids {bad} are not in [0, {vocab_size})")
        return tuple(sorted({int(s) for s in stop})), ()
    raise UserError(f"sample: stop must be a list of strings or a list of token ids, got {list(stop)!r}")
