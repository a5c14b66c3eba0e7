"""ASGI guards in front of every route of inflight's servers (`serve`, `serve-engine`, `env serve`): the
X-API-Key check (which also names, for `inflight serve`, the request's tenant) and the request body's size
and deadline. Beside `connections.py` (the head's and the answer's bounds), not under `api/`: the engine and
environment servers use them too, and neither may import the service.

Pure ASGI (no BaseHTTPMiddleware) so long-polls and large bodies pass through without extra buffering
beyond the size check.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import os
import socket
from collections.abc import Sequence
from typing import Annotated

from pydantic import AfterValidator
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inflight.errors import UserError

OPEN_PATHS = frozenset({"/api/v1/healthz"})  # load balancers probe without a key
# Where the key may also come as `Authorization: Bearer KEY`, the header Prometheus' scrape config sends.
BEARER_PATHS = frozenset({"/metrics"})
# The tenant of every request to a server without keys (loopback only): one shared namespace. No key's
# tenant is ever "" (`tenant_of` is 16 hex digits), so rows in it are invisible to every key.
SHARED_TENANT = ""
# What every tinker SDK requires its api_key to start with ("The api_key must start with the 'tml-'
# prefix"): a service key without it would lock every SDK client out. Only `inflight serve`'s keys: the
# engine and env servers' clients are inflight's own.
TINKER_KEY_PREFIX = "tml-"
# `inflight serve`'s key when no --api-key is given: an environment variable, out of `ps` and shell history.
SERVE_API_KEY_ENV = "INFLIGHT_SERVE_API_KEY"


def tenant_of(api_key: str | bytes) -> str:
    """The tenant an API key's requests act as: the first 16 hex digits of its SHA-256. Stored with every row
    a request creates, so the key itself is never stored; 64 bits keep two keys of one server apart."""
    key = api_key.encode() if isinstance(api_key, str) else api_key
    return hashlib.sha256(key).hexdigest()[:16]


def scope_tenant(scope: Scope) -> str:
    """The tenant `ApiKeyMiddleware` recorded for this request (`request.state.tenant`). A request it let
    through without a key (an open path, a signed archive link) has none: SHARED_TENANT, which on a server
    with keys owns nothing a key created."""
    tenant: str = scope.get("state", {}).get("tenant", SHARED_TENANT)
    return tenant


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on loopback only: every address it resolves to (as the bind would
    resolve it) is a loopback one. Aliases such as 127.1, 127.0.0.2, ::1 and localhost count; an empty host,
    0.0.0.0, :: and any name that resolves elsewhere (or not at all) do not."""
    if not host.strip():
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # unresolvable: the bind would fail anyway, and it is not provably local
        return False
    addresses = {str(info[4][0]).partition("%")[0] for info in infos}  # drop an IPv6 zone (fe80::1%eth0)
    return bool(addresses) and all(ipaddress.ip_address(address).is_loopback for address in addresses)


def check_api_keys(api_keys: Sequence[str], prefix: str = "") -> list[str]:
    """The keys, refused (UserError) if any is empty or blank: an empty key would read as "no key" and
    switch authentication off. With `prefix` (`inflight serve`'s TINKER_KEY_PREFIX), a key without it is
    refused too."""
    blank = [i for i, key in enumerate(api_keys) if not key.strip()]
    if blank:
        raise UserError(
            f"API key #{blank[0] + 1} is empty or blank, which would turn authentication off: pass a real "
            f"secret, e.g. `--api-key {prefix}$(openssl rand -hex 32)`, or no --api-key on a loopback host"
        )
    unprefixed = [i for i, key in enumerate(api_keys) if not key.startswith(prefix)]
    if unprefixed:  # never quoted: the message may end up in a log
        raise UserError(
            f"API key #{unprefixed[0] + 1} does not start with {prefix!r}, and every tinker SDK refuses an "
            f"api_key without it, so no client could send it: pass "
            f"`--api-key {prefix}$(openssl rand -hex 32)`"
        )
    return list(api_keys)


def _validated_keys(value: list[str], prefix: str = "") -> list[str]:
    try:
        return check_api_keys(value, prefix)
    except UserError as exc:  # pydantic reports ValueErrors as validation errors
        raise ValueError(str(exc)) from None


def _validated_tinker_keys(value: list[str]) -> list[str]:
    return _validated_keys(value, TINKER_KEY_PREFIX)


# A config's API keys (`EngineServerConfig`): a blank one is a validation error.
ApiKeys = Annotated[list[str], AfterValidator(_validated_keys)]
# The Tinker service's (`ServiceConfig`): a blank one, or one without TINKER_KEY_PREFIX, too.
TinkerApiKeys = Annotated[list[str], AfterValidator(_validated_tinker_keys)]


def keys_from(flags: Sequence[str], env_var: str, prefix: str = "") -> list[str]:
    """A server's keys: its --api-key flags, else the one in the environment variable `env_var` (where the
    clients of inflight's own servers read theirs: not in a config, which a run saves as config.json, nor on
    a command line, which every local user can read), else none. A blank one is refused: it would read as
    "no key". `prefix`: what the suggested secret starts with (`inflight serve`'s TINKER_KEY_PREFIX)."""
    if flags:
        return check_api_keys(flags, prefix)
    key = os.environ.get(env_var)
    if key is not None and not key.strip():
        raise UserError(
            f"{env_var} is set but blank: set a real secret (`{prefix}$(openssl rand -hex 32)`), or unset it"
        )
    return [] if key is None else [key]


def check_listening(host: str, api_keys: Sequence[str]) -> list[str]:
    """`inflight serve`'s keys (`check_api_keys`, each with TINKER_KEY_PREFIX), and a refusal to listen
    beyond loopback without one. Light (no torch): the CLI calls it before it imports the service, so the
    refusal takes no time."""
    # A blank key would read as none and open every route; one without the prefix, no SDK could send.
    api_keys = check_api_keys(api_keys, TINKER_KEY_PREFIX)
    if not api_keys and not is_loopback(host):
        raise UserError(
            f"refusing to serve on {host!r} without an API key: anyone who can reach it could train and "
            f"sample. Pass --api-key {TINKER_KEY_PREFIX}SECRET or set ${SERVE_API_KEY_ENV} (clients send "
            "it as X-API-Key / TINKER_API_KEY), or bind 127.0.0.1"
        )
    return api_keys


class ApiKeyMiddleware:
    """401 unless `X-API-Key` is one of the configured keys (compared in constant time); a request that
    passes carries its key's tenant (`tenant_of`) in `scope["state"]["tenant"]`, which the routes read as
    `request.state.tenant`. With no keys configured every route is open (a loopback-only server; `serve`
    refuses a public bind then) and every request is SHARED_TENANT.

    Paths under `signed_prefix` (checkpoint archive downloads, which the SDK fetches without the key)
    pass to their route, which answers 403 unless the link's own signature verifies. On `BEARER_PATHS` the
    key may come as a bearer token instead. Another server (`serve-engine`: `inference/access.py`) names
    its own open and bearer paths. A WebSocket handshake is checked as a request is (`env serve`'s /ws
    sessions): refused with the same 401 where the server can answer a handshake with a response, else
    closed (the client sees HTTP 403)."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: list[str],
        signed_prefix: str | None = None,
        open_paths: frozenset[str] = OPEN_PATHS,
        bearer_paths: frozenset[str] = BEARER_PATHS,
    ) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in check_api_keys(api_keys)]
        self.tenants = [tenant_of(key) for key in self.api_keys]  # hashed once, not per request
        self.signed_prefix = signed_prefix
        self.open_paths, self.bearer_paths = open_paths, bearer_paths

    def _open(self, path: str) -> bool:
        return path in self.open_paths or (
            self.signed_prefix is not None and path.startswith(self.signed_prefix)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._open(scope["path"]):
            await self.app(scope, receive, send)
            return
        if not self.api_keys:
            _set_tenant(scope, SHARED_TENANT)
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        if not given and scope["path"] in self.bearer_paths:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            given = token.strip() if scheme.lower() == b"bearer" else b""
        # Check every key (no early exit) so timing says nothing about which one nearly matched.
        matches = [hmac.compare_digest(given, key) for key in self.api_keys]
        if not any(matches):
            if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 1008})  # policy violation
                return
            response = JSONResponse({"detail": "missing or invalid X-API-Key header"}, status_code=401)
            await response(scope, receive, send)
            return
        _set_tenant(scope, self.tenants[matches.index(True)])
        await self.app(scope, receive, send)


def _set_tenant(scope: Scope, tenant: str) -> None:
    # A fresh dict, never the one the server handed in: were that shared between requests (uvicorn copies
    # its lifespan state per request, other servers need not), a tenant would leak into the next request.
    scope["state"] = {**scope.get("state", {}), "tenant": tenant}


class BodySizeLimitMiddleware:
    """413 for a body over its path's limit, whether announced by Content-Length or streamed in chunks:
    `max_bytes` on `large_paths`, `small_max_bytes` (by default the same) everywhere else. With
    `body_timeout_s`, 408 for a body not whole that long after its headers: uvicorn itself waits for a body
    forever, so a client trickling one would hold its connection (and its task) for good."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        small_max_bytes: int | None = None,
        large_paths: frozenset[str] = frozenset(),
        body_timeout_s: float | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.small_max_bytes = max_bytes if small_max_bytes is None else small_max_bytes
        self.large_paths = large_paths
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes if scope["path"] in self.large_paths else self.small_max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(limit, scope, receive, send)
            return
        # Read the whole body first (the routes would anyway), counting, then replay it.
        chunks: list[bytes] = []
        size = 0
        deadline = (
            None if self.body_timeout_s is None else asyncio.get_running_loop().time() + self.body_timeout_s
        )
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await self._too_slow(size, scope, receive, send)
                return
            if message["type"] != "http.request":
                return  # the client went away before sending its body: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(limit, scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                body = b"".join(chunks)
                chunks.clear()  # else held beside the joined copy until the answer: twice a body's memory
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_slow(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        """The answer ends the connection (`Connection: close`), so the rest of the body is never read."""
        response = JSONResponse(
            {
                "detail": f"the request body did not arrive within {self.body_timeout_s:g} s (only {size} "
                "bytes of it did): send it whole, without pauses, or over a faster connection"
            },
            status_code=408,
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)

    async def _refuse(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(
            {"detail": f"request body is larger than this server's limit of {limit} bytes"},
            status_code=413,
        )
        await response(scope, receive, send)
