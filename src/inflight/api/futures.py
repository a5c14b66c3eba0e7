"""Futures: the durable queue between thin routes (which submit) and the engine loop (which claims, finishes).

Owns idempotent submission on (model_id, seq_id), per-model seq_id order, terminal states and restart
recovery. Payloads are opaque bytes: what a request means is the routes' and the engine's business.
Every request passes through here three times (submit, claim, finish), so the statements are SQLAlchemy
Core, built once, on plain connections: a third of what ORM sessions cost per request (see the end).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal, cast, get_args

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    Select,
    Table,
    bindparam,
    case,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from inflight.api.db import Database, FutureRow, utcnow
from inflight.errors import UserError

FutureStatus = Literal["pending", "running", "done", "failed"]
ErrorCategory = Literal["user", "server"]

FIRST_SEQ_ID = 0  # create_model / create-via-load carry no seq_id: they hold 0, the SDK counts from 1
RESTART_ERROR = (
    "the server restarted while this request was running; it was not re-run because its effects may have "
    "been partly applied (accumulated gradients, an optimizer step, a half-written checkpoint). "
    "Reload the model from its last checkpoint and resubmit."
)


class RequestType(StrEnum):
    CREATE_MODEL = "create_model"
    LOAD_WEIGHTS = "load_weights"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    UNLOAD_MODEL = "unload_model"
    SAMPLE = "sample"

    @property
    def ordered(self) -> bool:
        # Samples read frozen weights, so they may run in any order and be batched freely; and sampling
        # clones number their seq_ids from offsets of 1e9, so waiting on gaps would wait forever.
        return self is not RequestType.SAMPLE


_ORDERED_TYPES = [t.value for t in RequestType if t.ordered]


class UnknownFutureError(UserError, KeyError):
    """No future has this request_id (routes answer 404)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class SeqIdConflictError(UserError, ValueError):
    """A (model_id, seq_id) was submitted again with a different request (routes answer 400, never 409)."""


class FutureFinishedError(UserError):
    """cancel_future on a future that already finished (routes answer 400: nothing is left to stop)."""


CANCELLED_ERROR = "cancelled by the client (cancel_future)"


class FutureStateError(RuntimeError):
    """An engine bug: finishing a future that is not in the state the transition needs."""


@dataclass(frozen=True)
class Future:
    """The internal view of one request; `request_id` is the opaque string the wire carries."""

    request_id: str
    model_id: str
    seq_id: int | None
    request_type: RequestType
    status: FutureStatus
    request_payload: bytes
    result_payload: bytes | None
    error: str | None
    error_category: ErrorCategory | None
    created_at: datetime
    finished_at: datetime | None
    tenant: str = ""  # who submitted it (auth.tenant_of); only they may retrieve or cancel it

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed")


@dataclass(frozen=True)
class ClaimedHeads:
    """What one `claim_ready` took: the heads, by model_id, and whether any of their models has later
    requests queued behind them (claim again once these have run)."""

    futures: list[Future]
    more_queued: bool


def _to_future(row: Row[Any]) -> Future:
    return Future(
        request_id=str(row.request_id),
        model_id=row.model_id,
        seq_id=row.seq_id,
        request_type=RequestType(row.request_type),
        status=cast(FutureStatus, row.status),
        request_payload=row.request_payload,
        result_payload=row.result_payload,
        error=row.error,
        error_category=cast(ErrorCategory | None, row.error_category),
        created_at=row.created_at,
        finished_at=row.finished_at,
        tenant=row.tenant,
    )


def check_owner(future: Future, tenant: str | None, request_id: str) -> Future:
    """`future`, unless `tenant` is given and did not submit it: then UnknownFutureError, worded as for a
    `request_id` (as the client wrote it) that names nothing, so another tenant's ids are never confirmed."""
    if tenant is not None and future.tenant != tenant:
        raise UnknownFutureError(f"unknown request_id {request_id!r}")
    return future


def _parse_request_id(request_id: str) -> int:
    if not request_id.isascii() or not request_id.isdigit() or len(request_id) > 18:
        raise UnknownFutureError(f"unknown request_id {request_id!r}: request ids are decimal integers")
    return int(request_id)


class FutureStore:
    """Thread-safe (each call is one transaction); several processes may share one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def submit(
        self,
        model_id: str,
        seq_id: int | None,
        request_type: RequestType,
        payload: bytes,
        *,
        max_seq_ahead: int | None = None,
        on_inserted: Callable[[Future], None] | None = None,
        tenant: str = "",
        max_unfinished_of_tenant: int | None = None,
    ) -> Future:
        """Queue a request, committed before this returns (a restart keeps it). The same (model_id, seq_id)
        with the same type and payload returns the original future (SDK retries); with a different one it
        raises SeqIdConflictError. With `max_seq_ahead`, a new seq_id more than that far above the model's
        highest is refused (UserError), checked in the same transaction. `on_inserted` gets a newly
        inserted future before the commit, so before any engine can claim and finish it. `tenant`: the
        submitter's (the caller has checked that `model_id` is theirs), recorded with the row.

        With `max_unfinished_of_tenant`, a new request while `tenant` already has that many pending or
        running is recorded as failed (category user; `reject`'s row, so its seq_id leaves no hole) with a
        message naming the limit. The count is the transaction's: on PostgreSQL, submitters at once may
        pass it together, by at most their number."""
        return self._insert(
            model_id,
            seq_id,
            request_type,
            payload,
            failure=None,
            max_seq_ahead=max_seq_ahead,
            on_inserted=on_inserted,
            tenant=tenant,
            max_unfinished_of_tenant=max_unfinished_of_tenant,
        )

    def reject(
        self,
        model_id: str,
        seq_id: int,
        request_type: RequestType,
        payload: bytes,
        error: str,
        *,
        max_seq_ahead: int | None = None,
        tenant: str = "",
    ) -> Future:
        """Record a request that is invalid but names a valid seq_id, as already failed (category user).

        It must still take its seq_id: the SDK has counted it, and a hole would stall the model's queue.
        """
        return self._insert(
            model_id,
            seq_id,
            request_type,
            payload,
            failure=error,
            max_seq_ahead=max_seq_ahead,
            on_inserted=None,
            tenant=tenant,
        )

    def get(self, request_id: str, *, tenant: str | None = None) -> Future:
        """The future; with `tenant`, only if that tenant submitted it (else as unknown: `check_owner`)."""
        with self.db.read_connection() as connection:
            return check_owner(_to_future(_row(connection, request_id)), tenant, request_id)

    def claim_next(self, model_id: str) -> Future | None:
        """Mark the model's next future running and return it, or None while the next seq_id is missing.

        Claims follow seq_id order with no skipping. A caller that claims several futures of one model
        before finishing them must execute them in the order claimed.
        """
        claimed = self.claim_ready(model_id).futures
        return claimed[0] if claimed else None

    def claim_ready(self, model_id: str | None = None, *, skip: Collection[str] = ()) -> ClaimedHeads:
        """Mark the head of every model whose next future in seq_id order is ready (or of `model_id`'s
        only) running, and return them: one query to find them, one UPDATE to claim them. The models in
        `skip` are left alone (a caller still running one of their requests over several rounds).

        A ready head stays ready until it leaves pending (every seq_id below it exists and none can return
        to pending), so the claim only has to re-check that it is still pending.
        """
        query, params = (_READY_HEADS, {}) if model_id is None else (_READY_HEADS_OF, {"model_id": model_id})
        # Look first under a shared read: an idle engine polling must not keep taking SQLite's write lock,
        # or submitters (whose busy handler backs off) starve behind it.
        with self.db.read_connection() as connection:
            heads = [head for head in connection.execute(query, params).all() if head.model_id not in skip]
        if not heads:
            return ClaimedHeads([], more_queued=False)
        with self.db.write_connection() as connection:
            claimed = _mark_running(connection, [head.request_id for head in heads])
        return ClaimedHeads(claimed, more_queued=any(head.queued > 1 for head in heads))

    def claim(self, request_ids: Sequence[str]) -> list[Future]:
        """Mark those of `request_ids` still pending running, in the order given, without looking for
        heads: for a caller that already knows each is its model's ready head (claim_ready's rule: its
        predecessor was claimed). Conditional on pending, so a claim that lost a race returns fewer."""
        with self.db.write_connection() as connection:
            return _mark_running(connection, [int(request_id) for request_id in request_ids])

    def ready_model_ids(self) -> list[str]:
        """Models whose next future in seq_id order is pending and claimable now."""
        with self.db.read_connection() as connection:
            return list(connection.scalars(_READY_MODEL_IDS).all())

    def pending_unordered_by_tenant(self, request_type: RequestType, per_tenant: int) -> dict[str, list[str]]:
        """Each tenant's oldest `per_tenant` pending futures of an unordered type (samples), oldest first:
        tenant -> request ids. The caller chooses whose turn it is and claims those with `claim`."""
        if request_type.ordered:
            raise ValueError(f"{request_type} futures are ordered: claim them with claim_next(model_id)")
        kind = {"request_type": request_type.value}
        pending: dict[str, list[int]] = {}
        with self.db.read_connection() as connection:  # see claim_ready: poll without the write lock
            for tenant in connection.scalars(_PENDING_TENANTS, kind).all():
                window = {**kind, "tenant": tenant, "per_tenant": per_tenant}
                pending[tenant] = list(connection.scalars(_PENDING_OF_TENANT, window))
        by_oldest = sorted((tenant for tenant, ids in pending.items() if ids), key=lambda t: pending[t][0])
        return {tenant: [str(request_id) for request_id in pending[tenant]] for tenant in by_oldest}

    def complete(self, request_id: str, result: bytes) -> Future:
        return self._finish(request_id, ("running",), status="done", result=result)

    def fail(self, request_id: str, error: str, category: ErrorCategory) -> Future:
        """Fail a pending or running future; the SDK raises RequestFailedError(category) for it."""
        return self._finish(request_id, ("pending", "running"), status="failed", error=(error, category))

    def cancel(self, request_id: str, *, tenant: str | None = None) -> Future:
        """Fail a pending or running sample with CANCELLED_ERROR (category user); idempotent once cancelled.

        Only samples: they read frozen weights and nothing waits on their seq_id, whereas cancelling a
        training request would leave its effects half-applied. The caller stops the running work. With
        `tenant`, another tenant's future is unknown, checked before anything about it is said.
        """
        with self.db.write_connection() as connection:
            row = _row(connection, request_id, for_update=True)
            check_owner(_to_future(row), tenant, request_id)
            if row.request_type != RequestType.SAMPLE.value:
                raise UserError(
                    f"request {request_id} is a {row.request_type} request; only sample requests can be "
                    "cancelled (training requests run in seq_id order and their effects cannot be undone)"
                )
            if row.status in ("done", "failed"):
                if row.error == CANCELLED_ERROR:  # a retried cancel: already in effect
                    return _to_future(row)
                raise FutureFinishedError(
                    f"request {request_id} already finished ({row.status}); only a pending or running "
                    "sample can be cancelled"
                )
            failed = _fail_rows(connection, CANCELLED_ERROR, "user", _FUTURES.c.request_id == row.request_id)
            return failed[0]

    def fail_pending(self, model_id: str, error: str, category: ErrorCategory) -> list[Future]:
        """Fail every pending future of one model, e.g. when its live state is lost or it is deleted."""
        return self._fail_where(
            error, category, _FUTURES.c.status == "pending", _FUTURES.c.model_id == model_id
        )

    def max_seq_id(self, model_id: str) -> int | None:
        """The highest seq_id submitted for this model (or sampling session), None before any."""
        with self.db.read_connection() as connection:
            return connection.scalar(_MAX_SEQ_ID, {"model_id": model_id})

    def unfinished_count(self, model_id: str | None = None) -> int:
        """Pending and running futures of one model, or of every model when `model_id` is None."""
        conditions: list[ColumnElement[bool]] = [_FUTURES.c.status.in_(("pending", "running"))]
        if model_id is not None:
            conditions.append(_FUTURES.c.model_id == model_id)
        with self.db.read_connection() as connection:
            return connection.scalar(select(func.count()).where(*conditions)) or 0

    def fail_stalled(self, older_than: datetime) -> list[Future]:
        """Fail pending ordered futures, submitted before `older_than`, that wait on a seq_id which never
        arrived (category user). Without this a client that skipped a seq_id would poll forever."""
        with self.db.read_connection() as connection:
            candidates = connection.scalars(
                select(_FUTURES.c.model_id)
                .where(
                    _FUTURES.c.status == "pending",
                    _FUTURES.c.request_type.in_(_ORDERED_TYPES),
                    _FUTURES.c.created_at < older_than,
                )
                .distinct()
            ).all()
            stalled = {
                model_id: missing
                for model_id in candidates
                if (missing := _missing_seq_id(connection, model_id)) is not None
            }
        failed: list[Future] = []
        for model_id, missing in stalled.items():
            error = (
                f"seq_id {missing} of {model_id!r} never arrived, and requests run in seq_id order: every "
                "later request was failed. Seq ids must be consecutive (create a new training client)."
            )
            failed += self._fail_where(
                error,
                "user",
                _FUTURES.c.status == "pending",
                _FUTURES.c.model_id == model_id,
                _FUTURES.c.created_at < older_than,
            )
        return failed

    def recover(self) -> list[Future]:
        """On start, before the engine loop: fail futures a dead server left running (category server).

        Pending futures stay queued; the engine decides whether they can still run. This assumes one
        server per database: a second live server's running futures would be failed too.
        """
        return self._fail_where(RESTART_ERROR, "server", _FUTURES.c.status == "running")

    def fail_unfinished(self, error_for: Callable[[FutureStatus, RequestType], str]) -> list[Future]:
        """Fail every pending and running future (category server) with `error_for(status, type)`: at
        shutdown, after the grace period. Like `recover`, it assumes one server per database."""
        with (
            self.db.write_connection() as connection
        ):  # one transaction: nothing moves from pending to running
            query = select(_FUTURES).where(_FUTURES.c.status.in_(("pending", "running")))
            rows = connection.execute(query.order_by(_FUTURES.c.request_id).with_for_update()).all()
            failed: list[Future] = []
            for row in rows:
                error = error_for(cast(FutureStatus, row.status), RequestType(row.request_type))
                _check_error(error, "server")
                failed += _fail_rows(connection, error, "server", _FUTURES.c.request_id == row.request_id)
            return failed

    def fail_orphaned(self, held: Collection[str], error: str) -> list[Future]:
        """Fail running futures that no work holds any more (category server), all but `held`.

        The engine loop calls this after a round that died midway, and periodically, so no future stays
        running because the work behind it was lost. Like `recover`, it assumes one server per database.
        """
        keep = [_parse_request_id(request_id) for request_id in held]
        return self._fail_where(
            error, "server", _FUTURES.c.status == "running", _FUTURES.c.request_id.notin_(keep)
        )

    def _insert(
        self,
        model_id: str,
        seq_id: int | None,
        request_type: RequestType,
        payload: bytes,
        failure: str | None,
        max_seq_ahead: int | None,
        on_inserted: Callable[[Future], None] | None,
        tenant: str,
        max_unfinished_of_tenant: int | None = None,
    ) -> Future:
        if seq_id is None and request_type.ordered:
            raise ValueError(f"{request_type} futures need a seq_id: they execute in seq_id order")
        if seq_id is not None and seq_id < FIRST_SEQ_ID:
            raise UserError(
                f"invalid seq_id {seq_id} for {model_id!r}: a model's seq ids start at {FIRST_SEQ_ID} (its "
                f"create_model), its other requests' at {FIRST_SEQ_ID + 1}"
            )
        digest = hashlib.sha256(payload).hexdigest()
        try:
            with self.db.write_connection() as connection:
                existing = None if seq_id is None else _find(connection, model_id, seq_id)
                if existing is not None:
                    return _same_request(existing, request_type, digest)
                if max_seq_ahead is not None and seq_id is not None:
                    _check_seq_window(connection, model_id, seq_id, max_seq_ahead)
                if failure is None and max_unfinished_of_tenant is not None:
                    failure = _tenant_queue_full(connection, tenant, max_unfinished_of_tenant)
                now = utcnow()
                row = connection.execute(
                    _INSERT,
                    {
                        "model_id": model_id,
                        "seq_id": seq_id,
                        "request_type": request_type.value,
                        "status": "pending" if failure is None else "failed",
                        "request_payload": payload,
                        "payload_sha256": digest,
                        "error": failure,
                        "error_category": None if failure is None else "user",
                        "created_at": now,
                        "finished_at": None if failure is None else now,
                        "tenant": tenant,
                    },
                ).one()  # raises IntegrityError on a concurrent duplicate
                future = _to_future(row)
                if on_inserted is not None and failure is None:
                    on_inserted(future)
                return future
        except IntegrityError:
            # Another submitter inserted the same pair between our read and insert (possible on PostgreSQL;
            # SQLite's BEGIN IMMEDIATE serialises writers). Its row is the one to return.
            assert seq_id is not None
            with self.db.read_connection() as connection:
                existing = _find(connection, model_id, seq_id)
                if existing is None:
                    raise
                return _same_request(existing, request_type, digest)

    def _finish(
        self,
        request_id: str,
        from_states: Sequence[str],
        *,
        status: FutureStatus,
        result: bytes | None = None,
        error: tuple[str, ErrorCategory] | None = None,
    ) -> Future:
        if error is not None:
            _check_error(*error)
        message, category = error if error is not None else (None, None)
        params = {
            "id": _parse_request_id(request_id),
            "from_states": list(from_states),
            "to_status": status,
            "result": result,
            "message": message,
            "category": category,
            "now": utcnow(),
        }
        with self.db.write_connection() as connection:
            # One conditional UPDATE: atomic against a concurrent finisher on every backend.
            finished = connection.execute(_FINISH, params).one_or_none()
            if finished is None:
                row = _row(connection, request_id)  # UnknownFutureError if there is none
                expected = " or ".join(from_states)
                raise FutureStateError(
                    f"cannot mark future {request_id} {status}: it is {row.status}, expected {expected}"
                )
            return _to_future(finished)

    def _fail_where(self, error: str, category: ErrorCategory, *conditions: Any) -> list[Future]:
        _check_error(error, category)
        with self.db.write_connection() as connection:
            return _fail_rows(connection, error, category, *conditions)


def _fail_rows(connection: Connection, error: str, category: ErrorCategory, *conditions: Any) -> list[Future]:
    """Fail the futures matching `conditions` in one UPDATE, returned by request_id."""
    rows = connection.execute(
        update(_FUTURES)
        .where(*conditions)
        .values(status="failed", error=error, error_category=category, finished_at=utcnow())
        .returning(_FUTURES)
    ).all()
    return sorted((_to_future(row) for row in rows), key=lambda future: int(future.request_id))


def _row(connection: Connection, request_id: str, *, for_update: bool = False) -> Row[Any]:
    # FOR UPDATE serialises concurrent finishers on PostgreSQL; SQLite already holds the write lock.
    query = _ROW.with_for_update() if for_update else _ROW
    row = connection.execute(query, {"request_id": _parse_request_id(request_id)}).one_or_none()
    if row is None:
        raise UnknownFutureError(f"unknown request_id {request_id!r}")
    return row


def _check_error(error: str, category: str) -> None:
    if category not in get_args(ErrorCategory):
        raise ValueError(f"error category must be one of {get_args(ErrorCategory)}, got {category!r}")
    if not error:
        raise ValueError("a failed future needs a non-empty error message")


def _find(connection: Connection, model_id: str, seq_id: int) -> Row[Any] | None:
    return connection.execute(_FIND, {"model_id": model_id, "seq_id": seq_id}).one_or_none()


def _same_request(existing: Row[Any], request_type: RequestType, digest: str) -> Future:
    if existing.request_type != request_type.value or existing.payload_sha256 != digest:
        raise SeqIdConflictError(
            f"seq_id {existing.seq_id} of {existing.model_id!r} was already used by request "
            f"{existing.request_id} ({existing.request_type}) with a different payload; "
            "a retry must resend the same request, a new request needs the next seq_id"
        )
    return _to_future(existing)


def _missing_seq_id(connection: Connection, model_id: str) -> int | None:
    """The lowest seq_id below the model's first pending one that was never submitted, if any (and only
    while nothing of the model runs: a running request is progress, not a gap)."""
    futures = _FUTURES.c
    ordered = [futures.model_id == model_id, futures.request_type.in_(_ORDERED_TYPES)]
    running = connection.scalar(select(func.count()).where(*ordered, futures.status == "running"))
    head = connection.scalars(
        select(futures.seq_id).where(*ordered, futures.status == "pending").order_by(futures.seq_id).limit(1)
    ).first()
    if running or head is None:
        return None
    present = set(connection.scalars(select(futures.seq_id).where(*ordered, futures.seq_id < head)).all())
    return next((seq for seq in range(FIRST_SEQ_ID, head) if seq not in present), None)


def _mark_running(connection: Connection, request_ids: Sequence[int]) -> list[Future]:
    """Claim those of `request_ids` still pending, in the order given. Conditional on pending, so two
    engines racing on PostgreSQL cannot both claim one."""
    rows = connection.execute(_MARK_RUNNING, {"request_ids": list(request_ids), "now": utcnow()}).all()
    claimed = {row.request_id: _to_future(row) for row in rows}
    return [claimed[request_id] for request_id in request_ids if request_id in claimed]


def _tenant_queue_full(connection: Connection, tenant: str, limit: int) -> str | None:
    """Why `tenant` may queue nothing more now, or None. Queued samples and training requests cost every
    tenant: the worker's claim looks over all that is pending, and the database grows with it."""
    unfinished = connection.scalar(_UNFINISHED_OF_TENANT, {"tenant": tenant}) or 0
    if unfinished < limit:
        return None
    return (
        f"this API key already has {unfinished} requests queued or running, the most this server queues "
        f"for one key (max_queued_requests_per_tenant={limit}): wait for some to finish (retrieve_future) "
        "before submitting more, then submit this one again"
    )


def _check_seq_window(connection: Connection, model_id: str, seq_id: int, max_ahead: int) -> None:
    highest = connection.scalar(_MAX_SEQ_ID, {"model_id": model_id})
    if seq_id > (highest or 0) + max_ahead:
        raise UserError(
            f"seq_id {seq_id} for {model_id!r} is too far ahead (highest so far: {highest}); the SDK numbers "
            "each model's requests 1, 2, 3, ... and the server runs them in that order"
        )


# ---- the statements of the request path, built once ------------------------------------------------------
# Measured on a 2-core Xeon: building the ready-heads statement takes ~0.8 ms and running it ~0.3 ms, and a
# request's submit + claim + finish cost ~1.9 ms through ORM sessions against ~0.8 ms on Core connections.
# So each statement is built here, with bound parameters (an UPDATE's may not share a column's name).

_FUTURES = cast(Table, FutureRow.__table__)


def _ready_heads_query(*, one_model: bool) -> Select[tuple[int, str, int]]:
    """(request_id, model_id, queued) of the models' ready heads (of the model bound as `model_id` if
    `one_model`), `queued` counting the model's pending ordered futures, the head included.

    A model's head is its lowest pending seq_id; it may run once every seq_id below it exists and has left
    pending (running, done, or failed, which a rejected or cancelled request can be out of order). seq_ids
    are unique, so "every one below exists" is a count, and a missing seq_id holds back the rest.
    The count reads every earlier future of the model, so it is the fallback: a head whose predecessor
    was claimed once (`started_at` set) is ready without it, since that claim found every seq_id below the
    predecessor present, and rows never return to pending nor go away. Only a predecessor that never ran
    (rejected, cancelled or failed while pending) needs the count. (The count alone made a claim grow with
    the model's history: 0.3 ms fresh, 4 ms after 20,000 requests.)
    """
    futures = _FUTURES.c
    pending = [futures.status == "pending", futures.request_type.in_(_ORDERED_TYPES)]
    if one_model:
        pending.append(futures.model_id == bindparam("model_id"))
    heads = (
        select(futures.model_id, func.min(futures.seq_id).label("seq_id"), func.count().label("queued"))
        .where(*pending)
        .group_by(futures.model_id)
        .subquery()
    )
    below = _FUTURES.alias("below")
    ordered_below = (below.c.model_id == heads.c.model_id, below.c.request_type.in_(_ORDERED_TYPES))
    predecessor_ran = (
        select(below.c.request_id)
        .where(*ordered_below, below.c.seq_id == heads.c.seq_id - 1, below.c.started_at.is_not(None))
        .exists()
    )
    count_below = (
        select(func.count()).where(*ordered_below, below.c.seq_id < heads.c.seq_id).scalar_subquery()
    )
    # CASE, not OR: evaluated in order on every backend, so the count runs only where the shortcut fails.
    ready = case(
        (heads.c.seq_id == FIRST_SEQ_ID, True),
        (predecessor_ran, True),
        else_=count_below == heads.c.seq_id - FIRST_SEQ_ID,
    )
    return (
        select(futures.request_id, futures.model_id, heads.c.queued)
        .join(heads, (futures.model_id == heads.c.model_id) & (futures.seq_id == heads.c.seq_id))
        .where(ready)
        .order_by(futures.model_id)
    )


_READY_HEADS = _ready_heads_query(one_model=False)
_READY_HEADS_OF = _ready_heads_query(one_model=True)
_READY_MODEL_IDS = _READY_HEADS.with_only_columns(_FUTURES.c.model_id)
_PENDING_OF_TYPE = (_FUTURES.c.status == "pending", _FUTURES.c.request_type == bindparam("request_type"))


def _pending_tenants_query() -> Select[Any]:
    """The tenants with pending futures of a type, by a loose scan of ix_futures_pending_tenant: one seek a
    tenant, where DISTINCT (or a window over tenants) reads every pending row, ~100 ms at 100,000."""
    first = select(func.min(_FUTURES.c.tenant).label("tenant")).where(*_PENDING_OF_TYPE)
    tenants = first.cte("pending_tenants", recursive=True)
    after = (
        select(func.min(_FUTURES.c.tenant)).where(*_PENDING_OF_TYPE, _FUTURES.c.tenant > tenants.c.tenant)
    ).scalar_subquery()
    tenants = tenants.union_all(select(after).where(tenants.c.tenant.is_not(None)))
    return select(tenants.c.tenant).where(tenants.c.tenant.is_not(None))


_PENDING_TENANTS = _pending_tenants_query()
_PENDING_OF_TENANT = (
    select(_FUTURES.c.request_id)
    .where(*_PENDING_OF_TYPE, _FUTURES.c.tenant == bindparam("tenant"))
    .order_by(_FUTURES.c.request_id)
    .limit(bindparam("per_tenant"))
)
_ROW = select(_FUTURES).where(_FUTURES.c.request_id == bindparam("request_id"))
# Led by status, so ix_futures_status_model bounds the scan to what is unfinished, whoever's it is.
_UNFINISHED_OF_TENANT = select(func.count()).where(
    _FUTURES.c.status.in_(("pending", "running")), _FUTURES.c.tenant == bindparam("tenant")
)
_FIND = select(_FUTURES).where(
    _FUTURES.c.model_id == bindparam("model_id"), _FUTURES.c.seq_id == bindparam("seq_id")
)
_MAX_SEQ_ID = select(func.max(_FUTURES.c.seq_id)).where(_FUTURES.c.model_id == bindparam("model_id"))
_INSERT = insert(_FUTURES).returning(_FUTURES)
_MARK_RUNNING = (
    update(_FUTURES)
    .where(
        _FUTURES.c.request_id.in_(bindparam("request_ids", expanding=True)), _FUTURES.c.status == "pending"
    )
    .values(status="running", started_at=bindparam("now"))
    .returning(_FUTURES)
)
_FINISH = (
    update(_FUTURES)
    .where(
        _FUTURES.c.request_id == bindparam("id"),
        _FUTURES.c.status.in_(bindparam("from_states", expanding=True)),
    )
    .values(
        status=bindparam("to_status"),
        result_payload=bindparam("result"),
        error=bindparam("message"),
        error_category=bindparam("category"),
        finished_at=bindparam("now"),
    )
    .returning(_FUTURES)
)
