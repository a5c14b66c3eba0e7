"""What every submitting route does: keep the model's seq_id queue whole, turn a bad request that names a
valid seq_id into an already failed future, wake the worker, answer with the future.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from inflight.api.access_log import annotate_future
from inflight.api.futures import Future, RequestType
from inflight.api.schemas import OrderedRequestHeader
from inflight.api.service import ServiceState
from inflight.errors import UserError

W = TypeVar("W", bound=BaseModel)
# How many of a body's validation errors a failed future's message names (a bad token list can hold
# thousands, and the message is stored with the future).
_ERRORS_NAMED = 5


def submit(
    state: ServiceState,
    tenant: str,
    model_id: str,
    seq_id: int,
    request_type: RequestType,
    payload: bytes,
    *,
    check: Callable[[], object] | None = None,
) -> Future:
    """Queue `tenant`'s request on `model_id` (the caller has checked the model is theirs: `model_base`).
    A `check` that raises UserError records the request as failed (category user) instead: the SDK has
    already counted its seq_id, so leaving a hole would stall every later request. Either way the row,
    with its tenant, is committed before this returns, so an acknowledged request survives a restart."""
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
            model_id, seq_id, request_type, payload, error, max_seq_ahead=max_seq_ahead, tenant=tenant
        )
    else:
        future = state.store.submit(
            model_id,
            seq_id,
            request_type,
            payload,
            max_seq_ahead=max_seq_ahead,
            on_inserted=state.board.accepted,
            tenant=tenant,
            max_unfinished_of_tenant=state.config.max_queued_requests_per_tenant,
        )
        state.wake(request_type, future)
    annotate_future(future)
    return future


def check_session_open(state: ServiceState, session_id: str, tenant: str, what: str) -> None:
    """Models and sampling sessions are created only in a session that is not finished: a finished
    session's models are unloaded, and nothing in it is kept alive again."""
    if state.session(session_id, tenant=tenant).status == "finished":
        raise UserError(
            f"session {session_id!r} is finished (closed by its client, or silent past the server's "
            f"session expiry): create {what} in a new session (a new ServiceClient)"
        )


def parse_body(wire: type[W], body: bytes) -> W:
    """A route's raw JSON body as `wire`, for the routes that read their body themselves so that a large one
    is parsed in the thread pool, not on the event loop. A bad body is answered as FastAPI answers one: a
    RequestValidationError (422) naming the field under "body"."""
    try:
        return wire.model_validate_json(body)
    except ValidationError as err:
        errors = err.errors(include_url=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def invalid_body_detail(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """A 422's detail: each error's location and message, without the input (FastAPI's own handler echoes
    it back, and crashes on a body that is not UTF-8)."""
    return [{"loc": [str(part) for part in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in errors]


def reject_invalid_body(
    state: ServiceState, tenant: str, request_type: RequestType, body: object, detail: list[dict[str, Any]]
) -> Future | None:
    """Record an ordered request whose body failed validation (`detail`, as its 422 would carry it) as an
    already failed future (category user) under its seq_id, when the body names a model and seq_id that
    `submit` would take; None otherwise (the caller answers the 422).

    The SDK numbered the request before sending it and only raises a 4xx for that one request, so a bare 422
    would leave a hole in the model's queue: every later request would wait on it until the stall sweep
    fails them, minutes later. As a failed future the SDK raises the error for this request alone.
    `body`: the JSON as parsed, or a route's raw bytes."""
    try:
        if isinstance(body, bytes):
            header = OrderedRequestHeader.model_validate_json(body)
        else:
            header = OrderedRequestHeader.model_validate(body)
    except ValidationError:
        return None
    named = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in detail[:_ERRORS_NAMED])
    more = f" (and {len(detail) - _ERRORS_NAMED} more)" if len(detail) > _ERRORS_NAMED else ""
    error = UserError(f"invalid {request_type.value} request: {named}{more}")

    def refuse() -> None:
        raise error

    # The same bytes again (an SDK retry) make the same payload, so a retry finds this future.
    payload = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True).encode()
    try:
        state.model_base(header.model_id, tenant=tenant)
        return submit(state, tenant, header.model_id, header.seq_id, request_type, payload, check=refuse)
    except UserError:  # no such model (of this tenant), a seq_id too far ahead or taken: the 422 says enough
        return None
