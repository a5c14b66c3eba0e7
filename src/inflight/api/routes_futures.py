"""retrieve_future: the long-poll every SDK call ends in (spec §3); cancel_future: the SDK's stop of a
sample it abandoned (a pending one never runs, a running one leaves the engine at its next step).

Hold a pending future up to `long_poll_hold_s` (~25 s, below the SDK's 45 s timeout) and answer as soon as
the worker has committed its result (handed over in memory, not read back), else `try_again` (the SDK
re-polls at once). Results go out as stored: protobuf for forward/forward_backward/sample, JSON for the
rest; a failure is HTTP 200 + {"error", "category"}. Only the tenant that submitted a future may retrieve or
cancel it; to any other its id is unknown (404), worded as for an id that names nothing.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from inflight.api.access_log import annotate, annotate_future
from inflight.api.futures import Future, RequestType, check_owner
from inflight.api.proto import PROTO_CONTENT_TYPE
from inflight.api.schemas import (
    CancelFutureRequest,
    FutureRetrieveRequest,
    TryAgainResponse,
    unfinished_or_failed,
)
from inflight.api.service import StateDep, TenantDep

router = APIRouter(prefix="/api/v1")

_PROTO_RESULTS = (RequestType.FORWARD, RequestType.FORWARD_BACKWARD, RequestType.SAMPLE)
# Re-read the database this often while holding, as a backstop should a wake-up ever be missed.
RECHECK_S = 1.0


@router.post("/retrieve_future")
async def retrieve_future(body: FutureRetrieveRequest, state: StateDep, tenant: TenantDep) -> Response:
    annotate(request_id=body.request_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.long_poll_hold_s
    with state.board.watch(body.request_id) as waiter:
        # A future this process accepted and has not finished is known without a read; the first time only,
        # so the re-reads below stay the backstop should a wake-up ever be missed.
        accepted = state.board.pending(body.request_id)
        while True:
            waiter.event.clear()  # before the read: a finish after it sets the event again
            # The worker hands over the future it just committed: answered without reading it back.
            future = waiter.finished or accepted
            if future is None:
                future = await run_in_threadpool(state.store.get, body.request_id)
            accepted = None
            check_owner(future, tenant, body.request_id)  # the future in hand: no read of its own
            annotate_future(future)
            if future.finished:
                return _answer(future)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return JSONResponse(TryAgainResponse(request_id=future.request_id).model_dump(mode="json"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.event.wait(), min(remaining, RECHECK_S))


@router.post("/cancel_future")
def cancel_future(body: CancelFutureRequest, state: StateDep, tenant: TenantDep) -> dict[str, str]:
    """Cancel a pending or running sample: 404 unknown id (or another tenant's), 400 finished or not a
    sample, idempotent.

    The database first (the cancel is then final: a result arriving later is dropped), then the engine."""
    annotate(request_id=body.request_id)
    future = state.store.cancel(body.request_id, tenant=tenant)
    annotate_future(future)
    state.cancel_sample(future.request_id)
    state.board.notify(future.request_id, future)  # long-polls answer the cancellation at once
    return {"request_id": future.request_id, "status": "cancelled"}


def _answer(future: Future) -> Response:
    failed = unfinished_or_failed(future)
    if failed is not None:
        return JSONResponse(failed.model_dump(mode="json"))
    media_type = PROTO_CONTENT_TYPE if future.request_type in _PROTO_RESULTS else "application/json"
    return Response(content=future.result_payload or b"", media_type=media_type)
