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
    instead: the SDK has already counted its seq_id, so leaving a hole would stall every later request."""
    if request_type.ordered:
        _check_seq_window(state, model_id, seq_id)
    error: str | None = None
    if check is not None:
        try:
            check()
        except UserError as err:
            error = str(err)
    if error is not None:
        future = state.store.reject(model_id, seq_id, request_type, payload, error)
    else:
        future = state.store.submit(model_id, seq_id, request_type, payload)
        state.wake()
    annotate_future(future)
    return future


def _check_seq_window(state: ServiceState, model_id: str, seq_id: int) -> None:
    highest = state.store.max_seq_id(model_id)
    limit = (highest or 0) + state.config.max_seq_id_ahead
    if seq_id > limit:
        raise UserError(
            f"seq_id {seq_id} for {model_id!r} is too far ahead (highest so far: {highest}); the SDK numbers "
            "each model's requests 1, 2, 3, ... and the server runs them in that order"
        )
