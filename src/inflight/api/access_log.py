"""One structured log line per HTTP request, and its latency in the metrics.

The line is JSON on the `inflight.api.requests` logger (INFO; route it like any Python logger):
  {"method": "POST", "path": "/api/v1/asample", "status": 200, "latency_ms": 3.2, "client": "127.0.0.1",
   "tenant": "9f86d081884c7d65", "request_id": "17", "sampling_session_id": "session-…:sample:0",
   "session_id": "session-…", "seq_id": 4}
`tenant` (on a server with API keys, once the key was accepted) is the key's tenant id, the first 16 hex
digits of its SHA-256 (`auth.tenant_of`): who sent the request, never the key itself. The other ids are what
the routes `annotate` and the route's path parameters; never a header (the API key), a
query string (a download link's signature) or a body. The same fields ride on the record as
`record.inflight_request` for handlers that format their own.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inflight.api.futures import Future, RequestType
from inflight.api.metrics import ServiceMetrics
from inflight.auth import scope_tenant

REQUEST_LOGGER = "inflight.api.requests"
UNMATCHED_ROUTE = "unmatched"  # a path no route serves: one metrics label, whatever the path was
_MAX_PATH_CHARS = 512
# A client may send any token as its method: the metrics label keeps to these (else "other").
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Path parameters worth a field, and the field each becomes.
_PATH_IDS = {"model_id": "model_id", "session_id": "session_id", "sampler_id": "sampling_session_id"}

_fields: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "inflight_request_log_fields", default=None
)


def annotate(**ids: Any) -> None:
    """Add ids to the current request's log line (None values are skipped; outside a request, nothing).

    Works from routes run in the thread pool: they see a copy of the context holding the same dict."""
    fields = _fields.get()
    if fields is not None:
        fields.update((key, value) for key, value in ids.items() if value is not None)


def annotate_future(future: Future) -> None:
    """The future a request submitted or asked about: its id, its model (or sampling session), its seq_id."""
    owner = "sampling_session_id" if future.request_type is RequestType.SAMPLE else "model_id"
    annotate(request_id=future.request_id, seq_id=future.seq_id, **{owner: future.model_id})


class AccessLogMiddleware:
    """Outermost: times every request (401s, 413s and 503s included), logs it, observes its latency."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.logger = logger or logging.getLogger(REQUEST_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering
        fields: dict[str, Any] = {}
        token = _fields.set(fields)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _fields.reset(token)
            seconds = time.perf_counter() - start
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.observe_request(method, _route(scope), status, seconds)
            self._log(scope, status, seconds, fields)

    def _log(self, scope: Scope, status: int, seconds: float, ids: dict[str, Any]) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        for param, field in _PATH_IDS.items():
            value = scope.get("path_params", {}).get(param)
            if isinstance(value, str):
                ids.setdefault(field, value)
        owner = ids.get("model_id") or ids.get("sampling_session_id")
        if isinstance(owner, str) and ":" in owner:  # "{session_id}:train:{n}" / "{session_id}:sample:{n}"
            ids.setdefault("session_id", owner.partition(":")[0])
        client = scope.get("client")
        tenant = scope_tenant(scope)  # set by the key check, on this same scope, once the key passed
        line = {
            "method": scope["method"][:16],
            "path": scope["path"][:_MAX_PATH_CHARS],
            "status": status,
            "latency_ms": round(seconds * 1000, 2),
            "client": client[0] if client else None,
            **({"tenant": tenant} if tenant else {}),
            **ids,
        }
        self.logger.info(json.dumps(line, default=str), extra={"inflight_request": line})


def _route(scope: Scope) -> str:
    """The route template that served the request (`/api/v1/samplers/{sampler_id}`), for bounded labels.

    Requests a guard answered before routing (401, 413, 503) are matched here against the app's routes."""
    route = scope.get("route")
    if route is None:
        app = scope.get("app")
        for candidate in getattr(getattr(app, "router", None), "routes", ()):
            match, _ = candidate.matches(scope)
            if match is not Match.NONE:
                route = candidate
                break
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE
