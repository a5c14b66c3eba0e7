"""What the thin routes share: the service's config, its stores, the worker to wake, and the board that
tells long-polls a future finished.

Owns no behaviour beyond lookups the routes repeat (a model's row, a base model's limits); `app.py` builds
one `ServiceState` per app and the routes reach it through `StateDep`, and the request's tenant (its API
key's, `auth.tenant_of`) through `TenantDep`. A lookup of another tenant's row answers exactly as one of an
id that does not exist, so ids of other tenants are never confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from inflight.api.archives import ArchiveSigner
from inflight.api.checkpoints import CheckpointStore, StorageLimits
from inflight.api.db import Database, ModelRow, SessionRow
from inflight.api.futures import Future, FutureStore, RequestType
from inflight.api.jobs import BaseModelLimits
from inflight.auth import TinkerApiKeys, scope_tenant
from inflight.config import RayConfig
from inflight.errors import UserError
from inflight.types import DtypeName

# The SDK gives up on a retrieve_future after 45 s and then backs off for up to 30 s (spec §3).
SDK_RETRIEVE_TIMEOUT_S = 45.0


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_models: dict[str, str] = Field(min_length=1)  # name clients use -> model dir or hub id
    state_dir: Path  # checkpoints, and the SQLite database unless db_url is set
    db_url: str | None = None
    api_keys: TinkerApiKeys = Field(default_factory=list)  # each starting with tml- (auth.TINKER_KEY_PREFIX)
    long_poll_hold_s: float = Field(default=25.0, gt=0)
    # Bodies of the routes that carry training and sampling data (forward_backward, forward, asample),
    # which parse them in the thread pool; every other route's body (sessions, models, optimizer steps,
    # checkpoints) is small, and FastAPI parses it on the event loop, so it gets a much lower limit.
    max_request_bytes: int = Field(default=64 * 2**20, ge=1024)
    max_small_request_bytes: int = Field(default=2**20, ge=1024)
    # From a request's headers to the end of its body (408 past it): 64 MiB needs ~0.5 MB/s. Without it
    # a key holder trickling bodies would hold connections open for good.
    request_body_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    # From a connection's start (or a later request's first byte) to the end of a request's head: request
    # line and headers (408 past it; inflight/connections.py). uvicorn bounds no head, so a client that
    # connects and sends nothing, or trickles headers, would hold a connection and a file descriptor.
    request_header_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # How long an answer may wait while its client reads none of it before the connection is aborted
    # (inflight/connections.py): an archive download read by nobody held its connection and open files.
    send_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    # Connections open at once; one more is answered 503 and closed unread (inflight/connections.py), so
    # that a flood of them cannot take the descriptors the database and checkpoints need. None: derived
    # from the open-files limit (`connections.default_max_connections`).
    max_connections: int | None = Field(default=None, ge=1)
    max_lora_rank: int = Field(default=64, ge=1)
    # Models (adapters and their optimizer state, in memory until their session finishes) one API key may
    # have loaded at once; a create_model beyond it is refused, naming how to free one.
    max_models_per_tenant: int = Field(default=64, ge=1)
    # The recorded size of one API key's unexpired checkpoints; a save past it fails (category user), naming
    # how to make room. Without it one key could fill the disk, and then every other key's saves and the
    # SQLite futures database on it fail. 50 GiB holds ~50 saves of a rank-32 adapter of an 8B model with
    # its AdamW moments (~1 GB each: a run's periodic saves), while a few dozen keys fit a multi-TB disk.
    # None: no quota (a single tenant, a disk watched otherwise); min_free_disk_bytes still holds. 0 is
    # refused, not read as "none" or as "unlimited": either reading would surprise half of its readers.
    max_checkpoint_bytes_per_key: int | None = Field(default=50 * 2**30, ge=1)
    # Free bytes a save must leave on the state dir's filesystem, whatever each key's quota: the database
    # needs room to commit, and many keys each within their quota can still fill a disk. Checked once a
    # save is written (its size is known only then), so keep it above the largest checkpoint. 0: no floor.
    min_free_disk_bytes: int = Field(default=2**30, ge=0)
    # Requests (training and samples) one API key may have pending or running at once; one more is
    # recorded as failed, naming the limit. The worker's claim looks over every pending sample, so one key
    # queueing 100,000 made each claim ~200 ms for all. A cookbook RL step queues one per group (~100).
    max_queued_requests_per_tenant: int = Field(default=10_000, ge=1)
    # Tokens in one forward or forward_backward request: bounds the memory a request holds while it runs
    # (its datums, its per-token outputs). The tinker SDK splits a call into
    # requests of at most 5 MB by its estimate, which counts >= 8 bytes a token (the input's 4, and the
    # targets' 4 as int32, 8 as the SDK's int64): at most 625,000 tokens, under this default, so an SDK
    # call is never refused; a raw body of 64 MiB could hold millions.
    max_tokens_per_train_request: int = Field(default=2**20, ge=1)
    # Tokens of one forward/forward_backward request the worker runs in a round (WorkerConfig): a larger
    # request runs a slice a round, so another key's training waits for a slice of it, not all of it.
    # None: two of the compute's micro-batches (`ServiceComputeConfig.max_batch_tokens`): 4,096 tokens on
    # a CPU, 16,384 on an accelerator.
    max_train_tokens_per_round: int | None = Field(default=None, ge=1)
    # A session with no heartbeat and no request this long (its client died without closing it) is finished
    # and its models unloaded (WorkerConfig.session_expiry_s); the SDK heartbeats every 10 s.
    session_expiry_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    dtype: DtypeName = "auto"  # base weights: see ServiceComputeConfig.dtype
    device: str = "auto"  # auto (CUDA when there is one, else cpu), cpu, cuda, cuda:N: everything runs there
    # Who samples: the built-in engine in this process, or per base model an `inflight serve-engine
    # --backend vllm` process this service starts (vLLM's CPU build; `launch/vllm_env.py`), reached over HTTP.
    engine: Literal["builtin", "vllm"] = "builtin"
    # local: the sampling engines and the training in this process (or, with vLLM, processes beside it);
    # ray: the engines (built-in, or vLLM processes) in actors on a Ray cluster, reached over HTTP, and the
    # training in an actor of its own (`launch/ray/`'s engines_on_ray and compute_on_ray, placed as `ray`
    # says). The API and the futures database stay in this process either way.
    launcher: Literal["local", "ray"] = "local"
    ray: RayConfig = Field(default_factory=RayConfig)
    default_max_tokens: int = Field(default=256, ge=1)  # when a sample request names no max_tokens
    max_num_samples: int = Field(default=256, ge=1)  # per sample request
    # per prompt position: a [prompt, k] table is built and sent back (vLLM's default cap is 20)
    max_topk_logprobs: int = Field(default=64, ge=1)
    # How far past the model's highest seq_id a request may land (a bigger jump is surely a client bug).
    max_seq_id_ahead: int = Field(default=64, ge=1)
    # On SIGTERM/SIGINT or the lifespan's end: how long the futures in flight may take to finish before
    # they are failed (shutdown.py). Orchestrators should allow ~10 s more before they kill the process.
    shutdown_grace_s: float = Field(default=20.0, ge=0, allow_inf_nan=False)

    @field_validator("long_poll_hold_s")
    @classmethod
    def _below_sdk_timeout(cls, value: float) -> float:
        if value >= SDK_RETRIEVE_TIMEOUT_S - 5:
            raise ValueError(
                f"long_poll_hold_s={value} must stay well below the SDK's {SDK_RETRIEVE_TIMEOUT_S:.0f} s "
                "retrieve timeout, or clients time out and back off"
            )
        return value

    @property
    def database_url(self) -> str:
        from inflight.api.db import sqlite_url

        return self.db_url or sqlite_url(self.state_dir / "service.db")

    @property
    def checkpoint_limits(self) -> StorageLimits:
        return StorageLimits(self.max_checkpoint_bytes_per_key, self.min_free_disk_bytes)


@dataclass(frozen=True)
class BaseModelInfo:
    name: str
    tokenizer_dir: str  # a local dir AutoTokenizer loads offline: get_info's tokenizer_id (spec §10)
    arch: str | None
    limits: BaseModelLimits


class NotFoundError(UserError, LookupError):
    """An id that names nothing on this server (routes answer 404)."""


@dataclass(eq=False)  # identity: one waiter per long-poll, kept in a set
class FinishWaiter:
    """One long-poll's wake-up: `event` is set when its future finishes, and `finished` holds the finished
    future when the notifier had it (its row is committed by then), so the answer needs no database read."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: Future | None = None


class CompletionBoard:
    """Wakes long-polls when their future finishes (thread-safe `notify`, called after the commit), and
    knows the futures this process accepted and has not finished, so a long-poll on one needs no read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[FinishWaiter]] = {}
        self._pending: dict[str, Future] = {}

    def accepted(self, future: Future) -> None:
        """A pending future was inserted: called before its commit, so before anything can finish it. (A
        commit that then fails leaves an entry nobody was told the id of: a long-poll that guessed it
        re-reads after RECHECK_S and gets its 404.)"""
        with self._lock:
            self._pending[future.request_id] = future

    def pending(self, request_id: str) -> Future | None:
        """The future as accepted, while this process has not notified its finish; else None (read it)."""
        with self._lock:
            return self._pending.get(request_id)

    @contextlib.contextmanager
    def watch(self, request_id: str) -> Iterator[FinishWaiter]:
        """Register before reading the future's state, so a finish in between is never missed."""
        waiter = FinishWaiter(asyncio.get_running_loop())
        with self._lock:
            self._waiters.setdefault(request_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id, set())
                waiters.discard(waiter)
                if not waiters:
                    self._waiters.pop(request_id, None)

    def notify(self, request_id: str, finished: Future | None = None) -> None:
        """`finished`: the future as committed, if the caller has it; without it the waiters read the row."""
        with self._lock:
            self._pending.pop(request_id, None)
            waiters = list(self._waiters.get(request_id, ()))
        for waiter in waiters:
            if finished is not None and finished.finished:
                waiter.finished = finished  # before the event: the waiter reads it once woken
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
                waiter.loop.call_soon_threadsafe(waiter.event.set)


@dataclass
class ServiceState:
    config: ServiceConfig
    db: Database
    store: FutureStore
    checkpoints: CheckpointStore
    base_models: dict[str, BaseModelInfo]
    board: CompletionBoard
    # The routes' nudge after a submit (the request's type, or None: look everywhere), so the worker
    # need not poll.
    wake_worker: Callable[[RequestType | None, Future | None], None]
    counters: Callable[[], Mapping[str, int]]  # the worker's counts, for /server_stats
    archive_signer: ArchiveSigner  # signs and checks checkpoint download links (one secret per process)
    # Stops a cancelled sample's engine work (the worker's `cancel_sample`); any thread.
    cancel_sample: Callable[[str], None] = lambda request_id: None
    # model_id -> (base model, tenant): see model_base
    _model_bases: dict[str, tuple[str, str]] = field(default_factory=dict, init=False, repr=False)

    def base_model(self, name: str) -> BaseModelInfo:
        info = self.base_models.get(name)
        if info is None:
            raise UserError(f"unknown base model {name!r}; this server serves: {sorted(self.base_models)}")
        return info

    def model(self, model_id: str, *, tenant: str) -> ModelRow:
        """The row of `tenant`'s model; NotFoundError, the same as for no such model, for another's."""
        with self.db.read() as session:
            row = session.get(ModelRow, model_id)
            if row is not None:
                session.expunge(row)  # keep its loaded values past the read's rollback
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"unknown model_id {model_id!r}: create it with create_model first")
        return row

    def model_base(self, model_id: str, *, tenant: str) -> str:
        """The base model of `tenant`'s existing model (NotFoundError otherwise), for the routes on every
        request's path. Cached: a model's base model and tenant never change and its row is never deleted,
        so the ownership check costs no database read either."""
        cached = self._model_bases.get(model_id)
        if cached is None:
            row = self.model(model_id, tenant=tenant)
            cached = self._model_bases[model_id] = (row.base_model, row.tenant)
        base_model, owner = cached
        if owner != tenant:
            raise NotFoundError(f"unknown model_id {model_id!r}: create it with create_model first")
        return base_model

    def session(self, session_id: str, *, tenant: str) -> SessionRow:
        """The row of `tenant`'s session; NotFoundError, the same as for no such session, for another's."""
        with self.db.read() as session:
            row = session.get(SessionRow, session_id)
            if row is not None:
                session.expunge(row)
        if row is None or row.tenant != tenant:
            raise NotFoundError(f"unknown session_id {session_id!r}: call create_session first")
        return row

    def wake(self, request_type: RequestType | None = None, accepted: Future | None = None) -> None:
        self.wake_worker(request_type, accepted)


def get_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


StateDep = Annotated[ServiceState, Depends(get_state)]


async def get_tenant(request: Request) -> str:
    """The request's tenant, as ApiKeyMiddleware recorded it. Async: FastAPI runs a sync dependency in
    the thread pool, a hop too many for a field read on every request."""
    return scope_tenant(request.scope)


TenantDep = Annotated[str, Depends(get_tenant)]
