"""What every submitting route does: keep the model's seq_id queue whole, turn a bad request that names a
valid seq_id into an already failed future, wake the worker, answer with the future.
"""

from __future__ import annotations

from collections.abc import Callable

from inflight.api.access_log import annotate_future
from inflight.api.futures import Future, RequestType
from inflight.api.service import ServiceState
from inflight.errors import UserError


def submit(
    state: ServiceState,
    model_id: str,
    seq_id: int,
    request_type: RequestType,
    payload: bytes,
    *,
    check: Callable[[], object] | None = None,
) -> Future:
    """Queue a request. A `check` that raises UserError records the request as failed (category user)
    instead: the SDK has already counted its seq_id, so leaving a hole would stall every later request.
    Either way the row is committed before this returns, so an acknowledged request survives a restart."""
    # An ordered seq_id far above the model's highest is surely a client bug: refused, and never recorded.
    max_seq_ahead = state.config.max_seq_id_ahead if request_type.ordered else None
    error: str | None = None
    if check is not None:
        try:
            check()
        except UserError as err:
            error = str(err)
    if error is not None:
        future = state.store.reject(
            model_id, seq_id, request_type, payload, error, max_seq_ahead=max_seq_ahead
        )
    else:
        future = state.store.submit(
            model_id,
            seq_id,
            request_type,
            payload,
            max_seq_ahead=max_seq_ahead,
            on_inserted=state.board.accepted,
        )
        state.wake(request_type, future)
    annotate_future(future)
    return future
