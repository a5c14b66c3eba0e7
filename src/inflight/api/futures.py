"""Futures: the durable queue between thin routes (which submit) and the engine loop (which claims, finishes).

Owns idempotent submission on (model_id, seq_id), per-model seq_id order, terminal states and restart
recovery. Payloads are opaque bytes: what a request means is the routes' and the engine's business.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal, cast, get_args

from sqlalchemy import ColumnElement, CursorResult, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

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

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed")


def _to_future(row: FutureRow) -> Future:
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
    )


def _parse_request_id(request_id: str) -> int:
    if not request_id.isascii() or not request_id.isdigit() or len(request_id) > 18:
        raise UnknownFutureError(f"unknown request_id {request_id!r}: request ids are decimal integers")
    return int(request_id)


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount


class FutureStore:
    """Thread-safe (each call is one transaction); several processes may share one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def submit(self, model_id: str, seq_id: int | None, request_type: RequestType, payload: bytes) -> Future:
        """Queue a request. The same (model_id, seq_id) with the same type and payload returns the original
        future (SDK retries); with a different one it raises SeqIdConflictError."""
        return self._insert(model_id, seq_id, request_type, payload, failure=None)

    def reject(
        self, model_id: str, seq_id: int, request_type: RequestType, payload: bytes, error: str
    ) -> Future:
        """Record a request that is invalid but names a valid seq_id, as already failed (category user).

        It must still take its seq_id: the SDK has counted it, and a hole would stall the model's queue.
        """
        return self._insert(model_id, seq_id, request_type, payload, failure=error)

    def get(self, request_id: str) -> Future:
        with self.db.read() as session:
            return _to_future(self._row(session, request_id))

    def claim_next(self, model_id: str) -> Future | None:
        """Mark the model's next future running and return it, or None while the next seq_id is missing.

        Claims follow seq_id order with no skipping. A caller that claims several futures of one model
        before finishing them must execute them in the order claimed.
        """
        # Look first under a shared read: an idle engine polling must not keep taking SQLite's write lock,
        # or submitters (whose busy handler backs off) starve behind it.
        with self.db.read() as session:
            if _ready_head(session, model_id) is None:
                return None
        with self.db.write() as session:
            head = _ready_head(session, model_id)
            if head is None or not _mark_running(session, head):
                return None
            return _to_future(head)

    def ready_model_ids(self) -> list[str]:
        """Models whose next future in seq_id order is pending and claimable now."""
        with self.db.read() as session:
            candidates = session.scalars(
                select(FutureRow.model_id)
                .where(FutureRow.status == "pending", FutureRow.request_type.in_(_ORDERED_TYPES))
                .distinct()
                .order_by(FutureRow.model_id)
            ).all()
            return [model_id for model_id in candidates if _ready_head(session, model_id) is not None]

    def claim_unordered(self, request_type: RequestType, limit: int) -> list[Future]:
        """Claim up to `limit` pending futures of an unordered type (samples), oldest first."""
        if request_type.ordered:
            raise ValueError(f"{request_type} futures are ordered: claim them with claim_next(model_id)")
        query = (
            select(FutureRow)
            .where(FutureRow.status == "pending", FutureRow.request_type == request_type.value)
            .order_by(FutureRow.request_id)
            .limit(limit)
        )
        with self.db.read() as session:  # see claim_next: poll without the write lock
            if session.scalars(query.with_only_columns(FutureRow.request_id)).first() is None:
                return []
        with self.db.write() as session:
            rows = session.scalars(query).all()
            return [_to_future(row) for row in rows if _mark_running(session, row)]

    def complete(self, request_id: str, result: bytes) -> Future:
        return self._finish(request_id, ("running",), status="done", result=result)

    def fail(self, request_id: str, error: str, category: ErrorCategory) -> Future:
        """Fail a pending or running future; the SDK raises RequestFailedError(category) for it."""
        return self._finish(request_id, ("pending", "running"), status="failed", error=(error, category))

    def cancel(self, request_id: str) -> Future:
        """Fail a pending or running sample with CANCELLED_ERROR (category user); idempotent once cancelled.

        Only samples: they read frozen weights and nothing waits on their seq_id, whereas cancelling a
        training request would leave its effects half-applied. The caller stops the running work.
        """
        with self.db.write() as session:
            row = self._row(session, request_id, for_update=True)
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
            row.status, row.error, row.error_category = "failed", CANCELLED_ERROR, "user"
            row.finished_at = utcnow()
            return _to_future(row)

    def fail_pending(self, model_id: str, error: str, category: ErrorCategory) -> list[Future]:
        """Fail every pending future of one model, e.g. when its live state is lost or it is deleted."""
        return self._fail_where(
            error, category, FutureRow.status == "pending", FutureRow.model_id == model_id
        )

    def max_seq_id(self, model_id: str) -> int | None:
        """The highest seq_id submitted for this model (or sampling session), None before any."""
        with self.db.read() as session:
            return session.scalar(select(func.max(FutureRow.seq_id)).where(FutureRow.model_id == model_id))

    def unfinished_count(self, model_id: str | None = None) -> int:
        """Pending and running futures of one model, or of every model when `model_id` is None."""
        conditions: list[ColumnElement[bool]] = [FutureRow.status.in_(("pending", "running"))]
        if model_id is not None:
            conditions.append(FutureRow.model_id == model_id)
        with self.db.read() as session:
            return session.scalar(select(func.count()).where(*conditions)) or 0

    def fail_stalled(self, older_than: datetime) -> list[Future]:
        """Fail pending ordered futures, submitted before `older_than`, that wait on a seq_id which never
        arrived (category user). Without this a client that skipped a seq_id would poll forever."""
        with self.db.read() as session:
            candidates = session.scalars(
                select(FutureRow.model_id)
                .where(
                    FutureRow.status == "pending",
                    FutureRow.request_type.in_(_ORDERED_TYPES),
                    FutureRow.created_at < older_than,
                )
                .distinct()
            ).all()
            stalled = {
                model_id: missing
                for model_id in candidates
                if (missing := _missing_seq_id(session, model_id)) is not None
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
                FutureRow.status == "pending",
                FutureRow.model_id == model_id,
                FutureRow.created_at < older_than,
            )
        return failed

    def recover(self) -> list[Future]:
        """On start, before the engine loop: fail futures a dead server left running (category server).

        Pending futures stay queued; the engine decides whether they can still run. This assumes one
        server per database: a second live server's running futures would be failed too.
        """
        return self._fail_where(RESTART_ERROR, "server", FutureRow.status == "running")

    def fail_unfinished(self, error_for: Callable[[FutureStatus, RequestType], str]) -> list[Future]:
        """Fail every pending and running future (category server) with `error_for(status, type)`: at
        shutdown, after the grace period. Like `recover`, it assumes one server per database."""
        with self.db.write() as session:  # one transaction: nothing moves from pending to running between
            query = select(FutureRow).where(FutureRow.status.in_(("pending", "running")))
            rows = session.scalars(query.order_by(FutureRow.request_id).with_for_update()).all()
            now = utcnow()
            for row in rows:
                error = error_for(cast(FutureStatus, row.status), RequestType(row.request_type))
                _check_error(error, "server")
                row.status, row.error, row.error_category, row.finished_at = "failed", error, "server", now
            return [_to_future(row) for row in rows]

    def fail_orphaned(self, held: Collection[str], error: str) -> list[Future]:
        """Fail running futures that no work holds any more (category server), all but `held`.

        The engine loop calls this after a round that died midway, and periodically, so no future stays
        running because the work behind it was lost. Like `recover`, it assumes one server per database.
        """
        keep = [_parse_request_id(request_id) for request_id in held]
        return self._fail_where(
            error, "server", FutureRow.status == "running", FutureRow.request_id.notin_(keep)
        )

    def _insert(
        self,
        model_id: str,
        seq_id: int | None,
        request_type: RequestType,
        payload: bytes,
        failure: str | None,
    ) -> Future:
        if seq_id is None and request_type.ordered:
            raise ValueError(f"{request_type} futures need a seq_id: they execute in seq_id order")
        if seq_id is not None and seq_id < FIRST_SEQ_ID:
            raise UserError(f"invalid seq_id {seq_id} for {model_id!r}: seq ids start at {FIRST_SEQ_ID}")
        digest = hashlib.sha256(payload).hexdigest()
        try:
            with self.db.write() as session:
                existing = None if seq_id is None else _find(session, model_id, seq_id)
                if existing is not None:
                    return _same_request(existing, request_type, digest)
                now = utcnow()
                row = FutureRow(
                    model_id=model_id,
                    seq_id=seq_id,
                    request_type=request_type.value,
                    status="pending" if failure is None else "failed",
                    request_payload=payload,
                    payload_sha256=digest,
                    error=failure,
                    error_category=None if failure is None else "user",
                    created_at=now,
                    finished_at=None if failure is None else now,
                )
                session.add(row)
                session.flush()  # assigns request_id; raises IntegrityError on a concurrent duplicate
                return _to_future(row)
        except IntegrityError:
            # Another submitter inserted the same pair between our read and insert (possible on PostgreSQL;
            # SQLite's BEGIN IMMEDIATE serialises writers). Its row is the one to return.
            assert seq_id is not None
            with self.db.read() as session:
                existing = _find(session, model_id, seq_id)
                if existing is None:
                    raise
                return _same_request(existing, request_type, digest)

    def _row(self, session: Session, request_id: str, *, for_update: bool = False) -> FutureRow:
        # FOR UPDATE serialises concurrent finishers on PostgreSQL; SQLite already holds the write lock.
        row = session.get(FutureRow, _parse_request_id(request_id), with_for_update=for_update)
        if row is None:
            raise UnknownFutureError(f"unknown request_id {request_id!r}")
        return row

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
        with self.db.write() as session:
            row = self._row(session, request_id, for_update=True)
            if row.status not in from_states:
                expected = " or ".join(from_states)
                raise FutureStateError(
                    f"cannot mark future {request_id} {status}: it is {row.status}, expected {expected}"
                )
            row.status = status
            row.result_payload = result
            row.error, row.error_category = error if error is not None else (None, None)
            row.finished_at = utcnow()
            return _to_future(row)

    def _fail_where(self, error: str, category: ErrorCategory, *conditions: Any) -> list[Future]:
        _check_error(error, category)
        with self.db.write() as session:
            query = select(FutureRow).where(*conditions).order_by(FutureRow.request_id).with_for_update()
            rows = session.scalars(query).all()
            now = utcnow()
            for row in rows:
                row.status, row.error, row.error_category, row.finished_at = "failed", error, category, now
            return [_to_future(row) for row in rows]


def _check_error(error: str, category: str) -> None:
    if category not in get_args(ErrorCategory):
        raise ValueError(f"error category must be one of {get_args(ErrorCategory)}, got {category!r}")
    if not error:
        raise ValueError("a failed future needs a non-empty error message")


def _find(session: Session, model_id: str, seq_id: int) -> FutureRow | None:
    return session.scalars(
        select(FutureRow).where(FutureRow.model_id == model_id, FutureRow.seq_id == seq_id)
    ).one_or_none()


def _same_request(existing: FutureRow, request_type: RequestType, digest: str) -> Future:
    if existing.request_type != request_type.value or existing.payload_sha256 != digest:
        raise SeqIdConflictError(
            f"seq_id {existing.seq_id} of {existing.model_id!r} was already used by request "
            f"{existing.request_id} ({existing.request_type}) with a different payload; "
            "a retry must resend the same request, a new request needs the next seq_id"
        )
    return _to_future(existing)


def _ready_head(session: Session, model_id: str) -> FutureRow | None:
    # The head is the lowest pending seq_id; it may run once every seq_id below it exists and has left
    # pending (running, done, or failed, which a rejected or cancelled request can be out of order).
    # seq_ids are unique, so "every one below exists" is a count, and a missing seq_id holds back the rest.
    ordered = [FutureRow.model_id == model_id, FutureRow.request_type.in_(_ORDERED_TYPES)]
    head = session.scalars(
        select(FutureRow).where(*ordered, FutureRow.status == "pending").order_by(FutureRow.seq_id).limit(1)
    ).first()
    if head is None or head.seq_id is None:
        return None
    below = session.scalar(select(func.count()).where(*ordered, FutureRow.seq_id < head.seq_id))
    return head if below == head.seq_id - FIRST_SEQ_ID else None


def _missing_seq_id(session: Session, model_id: str) -> int | None:
    """The lowest seq_id below the model's first pending one that was never submitted, if any (and only
    while nothing of the model runs: a running request is progress, not a gap)."""
    ordered = [FutureRow.model_id == model_id, FutureRow.request_type.in_(_ORDERED_TYPES)]
    running = session.scalar(select(func.count()).where(*ordered, FutureRow.status == "running"))
    head = session.scalars(
        select(FutureRow.seq_id)
        .where(*ordered, FutureRow.status == "pending")
        .order_by(FutureRow.seq_id)
        .limit(1)
    ).first()
    if running or head is None:
        return None
    present = set(session.scalars(select(FutureRow.seq_id).where(*ordered, FutureRow.seq_id < head)).all())
    return next((seq for seq in range(FIRST_SEQ_ID, head) if seq not in present), None)


def _mark_running(session: Session, row: FutureRow) -> bool:
    # Conditional on still being pending, so two engines racing on PostgreSQL cannot both claim it.
    result = session.execute(
        update(FutureRow)
        .where(FutureRow.request_id == row.request_id, FutureRow.status == "pending")
        .values(status="running", started_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if _rowcount(result) != 1:
        return False
    session.refresh(row)
    return True
