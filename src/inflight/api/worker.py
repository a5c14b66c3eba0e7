"""The worker: one thread owns the ServiceCompute, claims ready futures, batches them and writes results.

One round (`run_once`), schedule -> execute -> update:
  1. claim the head of every model whose next seq_id is ready: one future per model per round, so each
     model's requests run strictly in seq_id order while different models advance together;
  2. run the heads that change a model or write files (create, load, optim_step, saves) one by one;
  3. run the forward / forward_backward heads as ONE training pass per base model, across LoRA adapters; a
     request larger than `max_train_tokens_per_round` runs a slice of its datums a round
     (`trainer/job_slices.py`), beside the next rounds' requests of other models, its own model's next
     request waiting for its last slice: one key's large request no longer holds every other key's
     training until it ends;
  4. settle the samples the engine finished, and hand the pending samples of every sampling session to the
     shared engine (`sampler.py`: one engine loop per base model, continuous batching across sessions and
     adapters). Samples finish asynchronously: a long one never holds up another tenant's training.
Routes only write futures and `wake(request_type)` the loop, which then looks only where work can be: the
ordered queues after a training request (again while claimed models have more queued), the samples after a
sample request or an engine result, everything on a timed-out wait (the backstop). `on_finished(request_id,
future)` hands long-polls the future just committed, so they answer without reading it back.
The compute's trainer side is never touched from any other thread; the sampler's loops only generate.
Every failure becomes a failed future (user or server category) and a count in `counters`; the loop itself
never dies. No future stays running: one claimed in a round that dies midway (a DB hiccup, an error outside
any one request) is failed at once, and a periodic sweep fails any running future this worker does not
hold (`failed_orphaned`). The same sweep finishes the sessions whose client went silent (no heartbeat, no
request: `session_expiry_s`) and unloads the models of finished sessions.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError

from inflight.api import jobs
from inflight.api.checkpoints import CheckpointStore
from inflight.api.db import (
    CREATION_FAILED,
    Database,
    FutureRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    utcnow,
)
from inflight.api.futures import (
    FIRST_SEQ_ID,
    ClaimedHeads,
    Future,
    FutureStateError,
    FutureStore,
    RequestType,
)
from inflight.api.ids import CheckpointKind, checkpoint_path, new_sampling_session_id, parse_model_id
from inflight.api.metrics import ServiceMetrics
from inflight.api.proto import (
    encode_forward_backward_output,
    encode_sample_output,
    forward_backward_job,
    parse_forward_backward,
)
from inflight.api.sampler import SampleCancelledError, Sampler
from inflight.api.schemas import (
    CreateModelRequest,
    CreateModelResponse,
    LoadWeightsRequest,
    LoadWeightsResponse,
    OptimStepRequest,
    OptimStepResponse,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsForSamplerResponse,
    SaveWeightsRequest,
    SaveWeightsResponse,
)
from inflight.errors import UserError
from inflight.trainer.job_slices import job_tokens, merge_outputs, split_job
from inflight.trainer.tinker_losses import prepare_job

if TYPE_CHECKING:
    from inflight.api.compute import Compute
    from inflight.api.job_types import ForwardBackwardJob, ForwardBackwardOutput, SampleOutput

log = logging.getLogger(__name__)

_PASSES = (RequestType.FORWARD, RequestType.FORWARD_BACKWARD)
# A sample future, its request, and what the engine made of it.
_Sampled = tuple[Future, SampleRequest, "concurrent.futures.Future[SampleOutput]"]
RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass
class _SlicedPass:
    """A forward/forward_backward request over more than a round's share of tokens: a slice of its datums
    runs each round; its future stays running (and its model's next request unclaimed) until the last."""

    future: Future
    job: ForwardBackwardJob
    base_model: str
    slices: deque[ForwardBackwardJob]  # not yet run, in order
    outputs: list[ForwardBackwardOutput] = field(default_factory=list)


# A pass's entry: the future, the job (or slice of it) to run now, and its sliced pass if it has one.
_PassItem = tuple[Future, "ForwardBackwardJob", _SlicedPass | None]


class WorkerConfig(BaseModel):
    idle_poll_s: float = Field(default=0.05, gt=0)  # a backstop: routes wake the loop on every submit
    # Heads this process accepted are claimed by id when this worker ran their predecessor; the ready-heads
    # query, which also finds what another process queued, still runs at least this often (`_claim_heads`).
    heads_query_interval_s: float = Field(default=0.5, gt=0)
    # Sample futures handed to the engine and not yet finished; more wait in the database, claimed as these
    # finish (the engine batches whatever it holds, across sessions and adapters).
    max_sample_futures_in_flight: int = Field(default=64, ge=1)
    # Sequences (num_samples summed) one tenant may have with the engines before its next sample waits in
    # the database: the engine admits in arrival order, so without it one tenant's backlog would fill the
    # engine's queue ahead of every other tenant's samples. None: the rows the smallest sampling engine
    # decodes together, which the app reads from its compute (unbounded in a worker built without one).
    # A tenant with nothing in flight always gets one request in.
    max_samples_in_flight_per_tenant: int | None = Field(default=None, ge=1)
    housekeeping_interval_s: float = Field(default=5.0, gt=0)
    seq_gap_timeout_s: float = Field(default=300.0, gt=0)
    # How long `stop` waits for the round in progress (a shutdown has failed its futures by then).
    stop_timeout_s: float = Field(default=10.0, gt=0)
    default_max_tokens: int = Field(default=256, ge=1)
    max_num_samples: int = Field(default=256, ge=1)
    max_topk_logprobs: int = Field(default=64, ge=1)
    # Tokens of one forward/forward_backward request a round runs (whole datums; at least one). A larger
    # request runs over several rounds, so another key's request waits for a slice of it, not all of it
    # (a 2^20-token request held every other key's training for minutes on 2 CPU cores). A slice of at
    # least one micro-batch (`ServiceComputeConfig.max_batch_tokens`) costs nothing in compute, and one
    # round of database work (~1 ms). None: never sliced; the app sets twice the compute's micro-batch.
    max_train_tokens_per_round: int | None = Field(default=None, ge=1)
    # In-memory sampler snapshots kept per model (each RL step makes one); older ones are freed.
    max_snapshots_per_model: int = Field(default=8, ge=1)
    # Sampler checkpoints (tinker:// paths) kept loaded in the engines, the least recently sampled evicted
    # (and read from disk again when sampled again): every one ever sampled used to stay, ~2.7 MB each of
    # the tiny model's rank 64, so one tenant saving and sampling checkpoints ran the server out of memory.
    max_checkpoint_adapters: int = Field(default=64, ge=1)
    # A session whose client sent no heartbeat (every SDK sends one every 10 s) and no request for this long,
    # with nothing of its own queued or running, is finished, and its models unloaded: a client that died
    # without closing its session otherwise held its adapters in memory, and its key's models-per-key room,
    # for good.
    session_expiry_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)


ORPHANED_ERROR = (
    "internal error: the server lost the work of this request while it ran (see the server log); it was "
    "not retried because its effects may have been partly applied. Resubmit it."
)


class ModelUnavailableError(RuntimeError):
    """The model has no live adapter (lost in a restart, failed to create, or unloaded)."""


class EngineWorker:
    def __init__(
        self,
        compute: Compute,
        sampler: Sampler,
        db: Database,
        checkpoints: CheckpointStore,
        *,
        limits: dict[str, jobs.BaseModelLimits],
        on_finished: Callable[[str, Future | None], None] = lambda request_id, finished: None,
        config: WorkerConfig | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.compute = compute
        self.sampler = sampler
        self.db = db
        self.store = FutureStore(db)
        self.checkpoints = checkpoints
        self.limits = limits
        self.on_finished = on_finished
        self.config = config or WorkerConfig()
        self.metrics = metrics or ServiceMetrics()  # future latencies and tokens; counts stay in counters
        self.counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()  # routes read the counters from other threads
        # Snapshot keys registered in this process's engine (snapshots die with the process), and the
        # checkpoint paths loaded there, least recently sampled first (`max_checkpoint_adapters`).
        self._sampler_keys: set[str] = set()
        self._checkpoint_adapters: OrderedDict[str, datetime] = OrderedDict()  # path -> its save's time
        self._snapshots: dict[str, deque[str]] = defaultdict(deque)  # model_id -> snapshot keys, oldest first
        self._evicted: set[str] = set()
        self._base_of: dict[str, str] = {}
        self._held: set[str] = set()  # request ids claimed (marked running) and not yet settled
        self._sliced: dict[str, _SlicedPass] = {}  # model_id -> its request running a slice a round
        # Ordered futures the routes of this process accepted, and per model the highest seq_id this worker
        # claimed: the fast path of `_claim_heads`.
        self._accepted: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._claimed_seq: dict[str, int] = {}
        self._heads_queried_at = -float("inf")
        # Samples with the engine (request id -> its tenant and num_samples): their work is not lost when a
        # round fails, so they are held apart.
        self._sampling: dict[str, tuple[str, int]] = {}
        self._sample_turns: dict[str, int] = {}  # tenant -> when it last had a sample claimed (a count)
        self._turn_counter = itertools.count()
        # Filled by the engine loops' threads, drained by this one.
        self._sampled: queue.SimpleQueue[_Sampled] = queue.SimpleQueue()
        # Sample request ids cancelled by routes; re-applied after each round's submissions (see `cancel`).
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        # Where the next round must look (see `wake`); both at start, for what a restart left pending.
        self._hints_lock = threading.Lock()
        self._look_ordered = self._look_samples = True
        self._wake = threading.Event()  # rung after a hint is set
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stats(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self.counters)

    def _count(self, key: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[key] += n

    # -- lifecycle ------------------------------------------------------------------------------------

    def recover(self) -> None:
        """After a restart: fail what the dead process left running, mark live adapters lost (their
        weights were in its memory), drop half-written saves. Pending futures stay queued: create and
        load re-run, samples of base models and checkpoints re-run, the rest fail with a clear error."""
        for future in self.store.recover():
            self._count("failed_by_restart")
            self.on_finished(future.request_id, future)
        with self.db.write() as session:
            for row in session.scalars(select(ModelRow).where(ModelRow.status == "ready")):
                row.status = "lost"
        self.checkpoints.discard_staging()

    def start(self) -> None:
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="inflight-engine-worker", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Claim nothing more (any thread, returns at once); the round in progress still settles."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(self.config.stop_timeout_s)
            if self._thread.is_alive():
                log.warning("engine worker still busy after %.0f s; leaving it", self.config.stop_timeout_s)

    def wake(self, request_type: RequestType | None = None, accepted: Future | None = None) -> None:
        """A request was queued (any thread): look at its queue next round; None: look everywhere.
        `accepted`: the future just committed, if the caller has it (an ordered one may skip the query)."""
        if accepted is not None and accepted.request_type.ordered:
            self._accepted.put(accepted)
        self._hint(
            ordered=request_type is None or request_type.ordered,
            samples=request_type is None or not request_type.ordered,
        )

    def _hint(self, *, ordered: bool = False, samples: bool = False) -> None:
        with self._hints_lock:
            self._look_ordered |= ordered
            self._look_samples |= samples
        self._wake.set()

    def _take_hints(self) -> tuple[bool, bool]:
        with self._hints_lock:
            hints = self._look_ordered, self._look_samples
            self._look_ordered = self._look_samples = False
        return hints

    def cancel_sample(self, request_id: str) -> None:
        """From a route thread, after the future was marked cancelled: stop its engine work now.

        The sampler aborts the job at once if it holds it; the id is also queued for this worker's
        thread, which re-applies it after its next submissions, covering a sample claimed but not yet
        handed to the engine when the cancel came."""
        self.sampler.cancel(request_id)
        self._cancels.put(request_id)
        self._hint(samples=True)

    def _apply_cancels(self) -> None:
        while True:
            try:
                request_id = self._cancels.get_nowait()
            except queue.Empty:
                return
            if self.sampler.cancel(request_id):
                self._count("samples_aborted")

    def _loop(self) -> None:
        last_housekeeping = time.monotonic()
        while not self._stop.is_set():
            ordered, samples = self._take_hints()
            try:
                self.run_once(ordered=ordered, samples=samples)
                if time.monotonic() - last_housekeeping >= self.config.housekeeping_interval_s:
                    last_housekeeping = time.monotonic()
                    self.housekeeping()
            except Exception:  # a DB hiccup must not kill the only thread that serves requests
                self._count("loop_errors")
                log.exception("engine worker round failed; retrying")
                self._held.clear()  # whatever the round had claimed and not settled is lost work now
                self._sliced.clear()
                self._fail_orphaned()
                self._stop.wait(self.config.idle_poll_s)  # then retry everything, without spinning
                self._hint(ordered=True, samples=True)
            # A hint set since `_take_hints` has rung the bell: the wait returns at once. A wait that times
            # out looks everywhere (another process's requests, anything a missed wake-up left).
            if not self._wake.wait(self.config.idle_poll_s):
                self._hint(ordered=True, samples=True)
            self._wake.clear()

    # -- one round ------------------------------------------------------------------------------------

    def run_once(self, *, ordered: bool = True, samples: bool = True) -> int:
        """Schedule, execute and record one round, claiming from the ordered queues and/or the samples;
        returns how many futures it settled or handed to the engine, or whose next slice it ran."""
        claimed = self._claim_heads() if ordered else ClaimedHeads([], more_queued=False)
        if claimed.more_queued:  # a claimed model's next request is queued: claim it next round
            self._hint(ordered=True)
        heads = claimed.futures
        self._held.update(f.request_id for f in heads)
        for future in heads:
            if future.request_type not in _PASSES:
                self._settle(future, self._run_single)
        passes: dict[str, list[Future]] = defaultdict(list)
        for future in heads:
            if future.request_type in _PASSES:
                try:
                    passes[self._base_model(future.model_id)].append(future)
                except Exception as err:
                    self._settle(future, err)
        continued = len(self._sliced)
        for sliced in self._sliced.values():
            passes.setdefault(sliced.base_model, [])
        for base_model, group in passes.items():
            self._run_passes(base_model, group)
        if self._sliced:  # their next slices run next round, without waiting for a wake-up
            self._hint(ordered=True)
        sampled = self._settle_samples()
        room = self.config.max_sample_futures_in_flight - len(self._sampling)
        claimed_samples: list[Future] = []
        if samples and room > 0:  # more beyond `room` wait until the engine finishes some (`_on_sampled`)
            claimed_samples = self._claim_samples(room)
        self._apply_cancels()
        return len(heads) + continued + len(claimed_samples) + sampled

    def _claim_heads(self) -> ClaimedHeads:
        """The ready head of every model, marked running: at most one per model per round.

        Fast path: an accepted future whose model's previous seq_id this worker claimed is that model's
        ready head by claim_ready's own rule (its predecessor ran; every seq_id below had left pending when
        the predecessor was claimed), so it is claimed by id, without the ready-heads query: ~0.8 ms of a
        small request's ~10 ms overhead on 2 cores. Anything else (a model's first request, a predecessor
        that never ran, a second request of one model, another process's requests) is left to the query,
        which runs whenever no accepted future qualifies and at least every `heads_query_interval_s`.
        A model whose request is still running a slice a round has no head claimed: its next request is
        left to the query, after the last slice."""
        accepted: list[Future] = []
        with contextlib.suppress(queue.Empty):
            while True:
                accepted.append(self._accepted.get_nowait())
        known: dict[str, Future] = {}
        for future in accepted:
            model_id, seq_id = future.model_id, future.seq_id
            predecessor_ran = seq_id is not None and self._claimed_seq.get(model_id) == seq_id - 1
            if predecessor_ran and model_id not in known and model_id not in self._sliced:
                known[model_id] = future
        now = time.monotonic()
        if known and now - self._heads_queried_at < self.config.heads_query_interval_s:
            heads = self.store.claim([future.request_id for future in known.values()])
            claimed = ClaimedHeads(heads, more_queued=len(accepted) > len(known))  # the rest: the query
        else:
            self._heads_queried_at = now
            claimed = self.store.claim_ready(skip=self._sliced.keys())
        for head in claimed.futures:
            if head.seq_id is not None:
                self._claimed_seq[head.model_id] = head.seq_id
        return claimed

    def _claim_samples(self, room: int) -> list[Future]:
        """Claim up to `room` pending samples and hand each to the engine, tenants taking turns: the next
        is always the oldest of the tenant with the fewest sequences in flight (then the one served least
        recently), and a tenant with `max_samples_in_flight_per_tenant` in flight waits for its own to
        finish, so one tenant's backlog queues no other tenant's sample behind it, in the database or in
        the engine's first-come queue. One claim per sample: its num_samples is known once it is read."""
        pending = {
            tenant: deque(request_ids)
            for tenant, request_ids in self.store.pending_unordered_by_tenant(
                RequestType.SAMPLE, room
            ).items()
        }
        claimed: list[Future] = []
        while pending and len(claimed) < room:
            in_flight: Counter[str] = Counter()
            for tenant, num_samples in self._sampling.values():
                in_flight[tenant] += num_samples
            share = self.config.max_samples_in_flight_per_tenant
            turns = [t for t in pending if share is None or in_flight[t] < share]
            if not turns:
                break
            tenant = min(turns, key=lambda t: (in_flight[t], self._sample_turns.get(t, -1)))
            request_id = pending[tenant].popleft()
            if not pending[tenant]:
                del pending[tenant]
            for future in self.store.claim([request_id]):  # none if another engine claimed it first
                self._sample_turns[tenant] = next(self._turn_counter)
                self._held.add(future.request_id)
                self._submit_samples([future])
                claimed.append(future)
        return claimed

    def housekeeping(self) -> None:
        self.checkpoints.delete_expired()
        older_than = utcnow() - timedelta(seconds=self.config.seq_gap_timeout_s)
        for future in self.store.fail_stalled(older_than):
            self._count("failed_seq_gap")
            self.on_finished(future.request_id, future)
        self._fail_orphaned()
        self._expire_silent_sessions()
        self._unload_finished_sessions()

    def _fail_orphaned(self) -> None:
        """Fail running futures whose work was lost, so their clients stop polling (never raises)."""
        try:
            orphaned = self.store.fail_orphaned(self._held.union(self._sampling), ORPHANED_ERROR)
        except Exception:  # the database is still away: the next housekeeping round tries again
            log.exception("could not fail the futures of a failed round")
            return
        for future in orphaned:
            log.error(
                "request %s (%s) was running when its work was lost", future.request_id, future.request_type
            )
            self._count("failed_orphaned")
            self.on_finished(future.request_id, future)

    def _settle(self, future: Future, work: Callable[[Future], bytes] | BaseException | bytes) -> None:
        """Run `work` (or take its outcome) and record it; the one place failures become futures.

        Raises only when the database refuses even the failure; the loop then fails what it holds."""
        outcome: bytes | BaseException
        if callable(work):
            try:
                outcome = work(future)
            except Exception as err:  # fault-tolerance boundary: one request's failure is its own
                outcome = err
        else:
            outcome = work
        finished: Future | None = None  # as committed; None: someone else finished it, read it back
        try:
            finished = self._record(future, outcome)
        except FutureStateError:
            # Finished meanwhile by someone else (a client's cancel_future raced the result): theirs stands.
            log.info("request %s finished before its outcome came; outcome dropped", future.request_id)
            self._count("outcomes_dropped_finished")
        except Exception:  # e.g. a result too large for its column: fail it rather than leave it running
            log.exception("could not record the outcome of request %s", future.request_id)
            self._count("failed_server")
            finished = self.store.fail(
                future.request_id, "internal error: the result could not be stored", "server"
            )
        self._held.discard(future.request_id)
        self.on_finished(future.request_id, finished)

    def _record(self, future: Future, outcome: bytes | BaseException) -> Future:
        if isinstance(outcome, bytes):
            finished = self.store.complete(future.request_id, outcome)
            self._count(f"done_{future.request_type}")
        elif isinstance(outcome, UserError):
            finished = self.store.fail(future.request_id, str(outcome) or type(outcome).__name__, "user")
            self._count("failed_user")
        else:
            clean = isinstance(outcome, ModelUnavailableError)
            message = str(outcome) if clean else f"internal error: {type(outcome).__name__}: {outcome}"
            if not clean:
                log.error("request %s (%s) failed", future.request_id, future.request_type, exc_info=outcome)
            finished = self.store.fail(future.request_id, message, "server")
            self._count("failed_server")
        seconds = (utcnow() - future.created_at).total_seconds()
        self.metrics.observe_future(
            future.request_type, "done" if isinstance(outcome, bytes) else "failed", seconds
        )
        return finished

    # -- requests that change a model or write files, one at a time -------------------------------------

    def _run_single(self, future: Future) -> bytes:
        handlers: dict[RequestType, Callable[[Future], bytes]] = {
            RequestType.CREATE_MODEL: self._create_model,
            RequestType.LOAD_WEIGHTS: self._load_weights,
            RequestType.OPTIM_STEP: self._optim_step,
            RequestType.SAVE_WEIGHTS: self._save_weights,
            RequestType.SAVE_WEIGHTS_FOR_SAMPLER: self._save_weights_for_sampler,
        }
        handler = handlers.get(future.request_type)
        if handler is None:
            raise UserError(f"request type {future.request_type} is not served")
        return handler(future)

    def _create_model(self, future: Future) -> bytes:
        request = _stored_request(CreateModelRequest, future)
        if not self.compute.has_adapter(future.model_id):
            try:
                self.compute.create_adapter(
                    future.model_id, request.base_model, jobs.lora_spec(request.lora_config)
                )
            except Exception:
                self._set_model_status(future.model_id, CREATION_FAILED)
                raise
        self._set_model_status(future.model_id, "ready")
        return CreateModelResponse(model_id=future.model_id).model_dump_json().encode()

    def _load_weights(self, future: Future) -> bytes:
        request = _stored_request(LoadWeightsRequest, future)
        try:
            # As the requesting model's tenant: its own checkpoint, or another's while published. The route
            # checked before queueing; checked again here, since it may have been unpublished since.
            checkpoint = self.checkpoints.get(request.path, reader=future.tenant)
            if request.optimizer and checkpoint.path.kind != "state":
                raise UserError(
                    f"{request.path} is a sampler checkpoint, which holds no optimizer state; load a "
                    "weights/ checkpoint, or load without the optimizer"
                )
            self.compute.load_state(future.model_id, checkpoint.storage_dir, load_optimizer=request.optimizer)
        except Exception:
            if future.seq_id == 0:  # create-via-load: the model exists only through this request
                self._set_model_status(future.model_id, CREATION_FAILED)
            raise
        self._set_model_status(future.model_id, "ready")
        return LoadWeightsResponse(path=request.path, model_id=future.model_id).model_dump_json().encode()

    def _optim_step(self, future: Future) -> bytes:
        self._require_adapter(future.model_id)
        step = jobs.optim_step(_stored_request(OptimStepRequest, future))
        metrics = self.compute.optim_step(step)
        return OptimStepResponse(metrics=metrics).model_dump_json().encode()

    def _save_weights(self, future: Future) -> bytes:
        self._require_adapter(future.model_id)
        request = _stored_request(SaveWeightsRequest, future)
        path = self._save(future, "state", request.path, request.ttl_seconds, request.overwrite)
        return SaveWeightsResponse(path=path).model_dump_json().encode()

    def _save_weights_for_sampler(self, future: Future) -> bytes:
        self._require_adapter(future.model_id)
        request = _stored_request(SaveWeightsForSamplerRequest, future)
        if request.path is not None:
            path = self._save(future, "sampler", request.path, request.ttl_seconds, overwrite=False)
            return SaveWeightsForSamplerResponse(path=path).model_dump_json().encode()
        if request.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
        session_id, _ = parse_model_id(future.model_id)
        sampling_session_id = new_sampling_session_id(session_id, request.sampling_session_seq_id)
        # An inflight client follows the model: every inflight save refreshes one shared key.
        key = sampling_session_id if request.kind == "snapshot" else f"{future.model_id}:inflight"
        update = self.compute.sampler_update(future.model_id, key)
        self.sampler.set_adapter(self._base_model(future.model_id), update)
        self._keep_snapshot(future.model_id, key)
        try:
            with self.db.write() as session:
                if session.get(SamplingSessionRow, sampling_session_id) is None:
                    session.add(
                        SamplingSessionRow(
                            sampling_session_id=sampling_session_id,
                            session_id=session_id,
                            sampling_session_seq_id=request.sampling_session_seq_id,
                            base_model=self._base_model(future.model_id),
                            snapshot_key=key,
                            tenant=future.tenant,  # the model's (the route checked it is the submitter's)
                        )
                    )
        except IntegrityError:
            raise UserError(
                f"sampling_session_seq_id {request.sampling_session_seq_id} of session {session_id!r} is "
                "already taken by another sampling session"
            ) from None
        return (
            SaveWeightsForSamplerResponse(sampling_session_id=sampling_session_id).model_dump_json().encode()
        )

    def _keep_snapshot(self, model_id: str, key: str) -> None:
        self._sampler_keys.add(key)
        self._evicted.discard(key)  # an inflight key is refreshed in place
        keys = self._snapshots[model_id]
        if key not in keys:
            keys.append(key)
        while len(keys) > self.config.max_snapshots_per_model:
            self._drop_snapshot(keys.popleft())

    def _drop_snapshot(self, key: str) -> None:
        self.sampler.remove_adapter(key)
        self._sampler_keys.discard(key)
        self._evicted.add(key)

    def _save(
        self, future: Future, kind: CheckpointKind, name: str | None, ttl_seconds: int | None, overwrite: bool
    ) -> str:
        path = checkpoint_path(future.model_id, kind, name or f"{future.seq_id:06d}")
        if not overwrite and self.checkpoints.exists(path):
            raise UserError(
                f"checkpoint {path} already exists; save under another name or pass overwrite=True"
            )
        # Again here, not only at the route: the saves queued before this one may have taken the room.
        self.checkpoints.check_room(future.tenant, path, overwrite=overwrite)
        with self.checkpoints.staging() as staged:
            if kind == "state":
                size = self.compute.save_state(future.model_id, staged, include_optimizer=True)
            else:
                size = self.compute.save_sampler_weights(future.model_id, staged)
            self.checkpoints.commit(
                path,
                staged,
                size_bytes=size,
                ttl_seconds=ttl_seconds,
                overwrite=overwrite,
                tenant=future.tenant,
            )
        return str(path)

    # -- batched passes and samples -------------------------------------------------------------------

    def _run_passes(self, base_model: str, futures: list[Future]) -> None:
        """One compute call for the base model: the next slice of each of its sliced requests, then its new
        forward/forward_backward heads (the first slice of any over a round's share), whatever adapter."""
        batch: list[_PassItem] = [
            (sliced.future, sliced.slices.popleft(), sliced)
            for sliced in self._sliced.values()
            if sliced.base_model == base_model
        ]
        for future in futures:
            try:
                self._require_adapter(future.model_id)
                message = parse_forward_backward(future.request_payload)
                vocab_size = self._limits(base_model).vocab_size
                job = forward_backward_job(message, vocab_size=vocab_size)
            except Exception as err:
                self._settle(future, err)
                continue
            slice_tokens = self.config.max_train_tokens_per_round
            slices = [job] if slice_tokens is None else split_job(job, slice_tokens)
            if len(slices) == 1:
                batch.append((future, job, None))
                continue
            sliced = _SlicedPass(future, job, base_model, deque(slices))
            self._sliced[future.model_id] = sliced
            self._count("sliced_passes")
            batch.append((future, sliced.slices.popleft(), sliced))
        if batch:
            self._forward_backward(batch)

    def _forward_backward(self, batch: list[_PassItem]) -> None:
        try:
            results: list[ForwardBackwardOutput | Exception] = self.compute.forward_backward(
                [job for _, job, _ in batch]
            )
        except UserError as err:
            # Per-job errors should come back in their slot; if the compute refused the whole batch up
            # front, run the jobs one by one so one bad request cannot fail its neighbours.
            if len(batch) == 1:
                self._pass_done(batch[0], err)
            else:
                self._count("batches_split")
                for item in batch:
                    self._forward_backward([item])
            return
        except Exception as err:
            for item in batch:
                self._pass_done(item, err)
            return
        self._count("fwdbwd_batches")
        self._count("fwdbwd_jobs", len(batch))
        for item, result in zip(batch, results, strict=True):
            self._pass_done(item, result)

    def _pass_done(self, item: _PassItem, result: ForwardBackwardOutput | BaseException) -> None:
        """Settle a pass's future, or keep a slice's output until its request's last slice has run."""
        future, job, sliced = item
        if not isinstance(result, BaseException) and job.backward:
            self.metrics.add_tokens("trained", job_tokens(job))
        if sliced is None:
            outcome = result if isinstance(result, BaseException) else encode_forward_backward_output(result)
            self._settle(future, outcome)
            return
        if not isinstance(result, BaseException):
            sliced.outputs.append(result)
            if sliced.slices:
                return  # the next slice runs next round
        # A failed slice fails the request; the slices before it keep their gradients, as the micro-batches
        # before a fault in one pass do (compute.forward_backward).
        del self._sliced[future.model_id]
        self._hint(ordered=True)  # the model's next request may be queued
        self._settle(future, result if isinstance(result, BaseException) else self._merged(sliced))

    def _merged(self, sliced: _SlicedPass) -> Callable[[Future], bytes]:
        def encode(_: Future) -> bytes:
            limits = self._limits(sliced.base_model)
            prepared = prepare_job(sliced.job, limits.vocab_size, limits.max_context)
            return encode_forward_backward_output(merge_outputs(prepared, sliced.outputs))

        return encode

    def _submit_samples(self, futures: list[Future]) -> None:
        """Hand each sample to the engine; it comes back through `_sampled` when its last sequence ends."""
        for future in futures:
            try:
                request = _stored_request(SampleRequest, future)
                base_model, weights = self._sampler(request.sampling_session_id or "")
                job = jobs.sample_job(
                    request,
                    base_model=base_model,
                    weights=weights,
                    limits=self._limits(base_model),
                    default_max_tokens=self.config.default_max_tokens,
                    max_num_samples=self.config.max_num_samples,
                    max_topk_logprobs=self.config.max_topk_logprobs,
                )
                pending = self.sampler.submit(job, key=future.request_id)
            except Exception as err:
                self._settle(future, err)
                continue
            self._held.discard(future.request_id)
            self._sampling[future.request_id] = (future.tenant, request.num_samples)
            self._count("sample_jobs")
            pending.add_done_callback(functools.partial(self._on_sampled, future, request))

    def _on_sampled(
        self, future: Future, request: SampleRequest, done: concurrent.futures.Future[SampleOutput]
    ) -> None:
        """On an engine loop's thread: queue the result for this thread, which owns the database writes."""
        self._sampled.put((future, request, done))
        self._hint(samples=True)  # to settle it, and its room in the engine may take a waiting sample

    def _settle_samples(self) -> int:
        """Record every sample the engine finished since the last round; returns how many."""
        settled = 0
        while True:
            try:
                future, request, done = self._sampled.get_nowait()
            except queue.Empty:
                return settled
            self._sampling.pop(future.request_id, None)
            error = done.exception()
            if isinstance(error, SampleCancelledError):  # the route recorded the cancel already
                self._count("samples_cancelled")
                self.on_finished(future.request_id, None)
                settled += 1
                continue
            self._held.add(future.request_id)  # _settle releases it
            if error is not None:
                self._settle(future, error)
            else:
                output = done.result()
                self.metrics.add_tokens("sampled", sum(len(sequence.tokens) for sequence in output.sequences))

                def encode(_: Future, output: SampleOutput = output, req: SampleRequest = request) -> bytes:
                    return encode_sample_output(
                        output,
                        prompt_logprobs_last_n=req.prompt_logprobs_last_n,
                        topk_prompt_logprobs=req.topk_prompt_logprobs,
                        topk_sample_logprobs=req.topk_sample_logprobs,
                        prompt_alt_tokens_k=req.prompt_alt_tokens_k,
                    )

                self._settle(future, encode)  # a failure to encode is this request's alone
            settled += 1

    def _sampler(self, sampling_session_id: str) -> tuple[str, str | None]:
        """(base model, engine weights key or None for the bare base model) of a sampling session."""
        with self.db.read() as session:
            row = session.get(SamplingSessionRow, sampling_session_id)
            if row is None:
                raise UserError(f"unknown sampling_session_id {sampling_session_id!r}")
            base_model, snapshot_key, model_path = row.base_model, row.snapshot_key, row.model_path
            tenant = row.tenant
        if snapshot_key is not None:
            if snapshot_key in self._evicted:
                raise UserError(
                    f"sampling session {sampling_session_id!r} sampled a snapshot that was freed: the server "
                    f"keeps the {self.config.max_snapshots_per_model} newest snapshots per model (and none "
                    "after its session finishes); save a named sampler checkpoint to keep weights longer"
                )
            if snapshot_key not in self._sampler_keys:
                raise ModelUnavailableError(
                    f"sampling session {sampling_session_id!r} sampled an in-memory snapshot of the adapter "
                    "that was lost when the server restarted; call save_weights_and_get_sampling_client again"
                )
            return base_model, snapshot_key
        if model_path is not None:
            # asample's check once more, for every sample: a checkpoint deleted, expired or unpublished
            # since it was loaded samples no more, not even from the engine's copy.
            checkpoint = self.checkpoints.get(model_path, reader=tenant)
            # A path deleted and saved again names new weights: the engine's copy is then replaced.
            if self._checkpoint_adapters.get(model_path) == checkpoint.created_at:
                self._checkpoint_adapters.move_to_end(model_path)
                return base_model, model_path
            owner, update = self.compute.read_sampler_update(model_path, checkpoint.storage_dir)
            self.sampler.set_adapter(owner, update)
            self._checkpoint_adapters[model_path] = checkpoint.created_at
            self._checkpoint_adapters.move_to_end(model_path)
            while len(self._checkpoint_adapters) > self.config.max_checkpoint_adapters:
                evicted, _ = self._checkpoint_adapters.popitem(last=False)
                self.sampler.remove_adapter(evicted)  # its running samples finish on it
            return base_model, model_path
        return base_model, None

    # -- models ---------------------------------------------------------------------------------------

    def _base_model(self, model_id: str) -> str:
        if model_id not in self._base_of:
            with self.db.read() as session:
                row = session.get(ModelRow, model_id)
                if row is None:
                    raise ModelUnavailableError(f"model {model_id!r} has futures but no row")
                self._base_of[model_id] = row.base_model
        return self._base_of[model_id]

    def _limits(self, base_model: str) -> jobs.BaseModelLimits:
        if base_model not in self.limits:
            raise UserError(
                f"base model {base_model!r} is no longer served (the server restarted without it)"
            )
        return self.limits[base_model]

    def _require_adapter(self, model_id: str) -> None:
        if self.compute.has_adapter(model_id):
            return
        with self.db.read() as session:
            row = session.get(ModelRow, model_id)
            status = row.status if row is not None else "missing"
        reasons = {
            "lost": "lost its live weights when the server restarted; create a new training client from its "
            "last checkpoint (create_training_client_from_state_with_optimizer) and resubmit",
            CREATION_FAILED: "failed to be created (see its create_model or load_weights error)",
            "unloaded": "was unloaded when its session finished (closed by its client, or silent for "
            f"{self.config.session_expiry_s:g} s: no heartbeat, no request); create a new training client "
            "(in a new session) from its last checkpoint to go on",
        }
        message = f"model {model_id!r} {reasons.get(status, 'has no live adapter')}"
        if status == "unloaded" or (
            status == CREATION_FAILED and self._creation_category(model_id) == "user"
        ):
            # the client's own doing: it finished the session, or its create_model was refused (e.g. a LoRA
            # config that trains nothing)
            raise UserError(message)
        raise ModelUnavailableError(message)

    def _creation_category(self, model_id: str) -> str | None:
        """The error category of the request that created the model (seq_id 0: its create_model, or a
        create-via-load): whose fault its failure was, and so every later request's failure on it."""
        with self.db.read() as session:
            return session.scalar(
                select(FutureRow.error_category).where(
                    FutureRow.model_id == model_id, FutureRow.seq_id == FIRST_SEQ_ID
                )
            )

    def _set_model_status(self, model_id: str, status: str) -> None:
        with self.db.write() as session:
            row = session.get(ModelRow, model_id)
            if row is not None:
                row.status = status

    def _expire_silent_sessions(self) -> None:
        """Finish the sessions whose client went silent (`session_expiry_s`); `_unload_finished_sessions`
        then unloads their models. A request counts as a sign of life as a heartbeat does: a client on raw
        HTTP that never heartbeats keeps its session while it sends requests."""
        cutoff = utcnow() - timedelta(seconds=self.config.session_expiry_s)
        expired: list[str] = []
        with self.db.write() as session:
            silent = select(SessionRow).where(
                SessionRow.status != "finished", SessionRow.last_heartbeat_at < cutoff
            )
            for row in session.scalars(silent).all():
                models = select(ModelRow.model_id).where(ModelRow.session_id == row.session_id)
                samplers = select(SamplingSessionRow.sampling_session_id).where(
                    SamplingSessionRow.session_id == row.session_id
                )
                alive = session.scalar(
                    select(FutureRow.request_id)
                    .where(
                        or_(FutureRow.model_id.in_(models), FutureRow.model_id.in_(samplers)),
                        or_(FutureRow.created_at >= cutoff, FutureRow.status.in_(("pending", "running"))),
                    )
                    .limit(1)
                )
                if alive is None:
                    row.status = "finished"
                    expired.append(row.session_id)
        for session_id in expired:
            log.warning(
                "session %s finished: no heartbeat or request for %g s (session_expiry_s); its models are "
                "unloaded",
                session_id,
                self.config.session_expiry_s,
            )
        if expired:
            self._count("sessions_expired", len(expired))

    def _unload_finished_sessions(self) -> None:
        with self.db.read() as session:
            model_ids = session.scalars(
                select(ModelRow.model_id)
                .join(SessionRow, SessionRow.session_id == ModelRow.session_id)
                .where(SessionRow.status == "finished", ModelRow.status == "ready")
            ).all()
        for model_id in model_ids:
            if self.store.unfinished_count(model_id) == 0 and self.compute.has_adapter(model_id):
                self.compute.delete_adapter(model_id)
                for key in self._snapshots.pop(model_id, ()):
                    self._drop_snapshot(key)
                self._claimed_seq.pop(model_id, None)
                self._set_model_status(model_id, "unloaded")
                self._count("adapters_unloaded")


def _stored_request(schema: type[RequestT], future: Future) -> RequestT:
    """A queued request's payload, checked again: a server with other limits (an older version, or other
    settings) may have accepted it. A payload that fails is the request's own user error."""
    try:
        return schema.model_validate_json(future.request_payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:3]
        )
        raise UserError(f"{future.request_type} request is invalid on this server: {problems}") from None
