"""Serve any registered inflight Env with OpenEnv's protocol: HTTP /reset /step /state /health /schema
/metadata and the /ws session channel. Owns the adapter between the two Environment classes; knows
nothing of what the env does.

Design decision: we run openenv-core's own server (`create_fastapi_app`, i.e. its HTTPEnvServer) with
a thin adapter Environment, not a FastAPI app of our own. The protocol *is* what that server does:
the WebSocket message and error types (INVALID_JSON, UNKNOWN_TYPE, VALIDATION_ERROR, EXECUTION_ERROR,
CAPACITY_REACHED, ...), stateless HTTP /reset and /step (a fresh env per request), one env per /ws
session with its own worker thread, capacity checks, MCP routes. Running the library's code makes us
exactly compliant, and keeps us so when it changes; our own app would copy ~1,700 lines and chase
them. Our Action/Observation models mirror OpenEnv's (same `metadata`, `done`, `reward` fields,
`extra="forbid"`), and the server only calls pydantic's `model_validate`, `model_dump` and
`model_json_schema` on them, so they pass through its serialisation unchanged. What is ours:
- the adapter: reset arguments are validated with OpenEnv's own `ResetRequest` (so a bad seed over
  /ws gets VALIDATION_ERROR, as it does over HTTP), a step with no episode in progress gets a message
  that says why (HTTP /step is stateless: episodes live in /ws sessions);
- concurrency: every session owns its env and the envs share nothing, so many sessions may run at
  once (`max_sessions`; openenv-core's default is one);
- bad reset arguments (a `UserError` from the env's `reset`) are a validation error: VALIDATION_ERROR
  over /ws and 422 over HTTP, as a bad seed is;
- HTTP error answers: another `UserError` is a 400, a step with no episode a 409, and an exception
  from the env a JSON 500 naming it (the server logs its traceback), instead of a bare "Internal
  Server Error" on a closed connection. Over /ws such an exception is EXECUTION_ERROR, as before. A
  422 quotes at most the first characters of a rejected input, never all of it, and these answers are
  ASCII JSON, so that no input they quote (a lone surrogate, a NaN) makes one fail;
- who may connect: with API keys (`--api-key`, else $INFLIGHT_ENV_API_KEY) every route but /health,
  the /ws handshake included, needs one as X-API-Key (`auth.py`'s check, as `inflight serve` uses
  it); without one the server listens on loopback only (`check_env_listening`). Request bodies are
  bounded (`max_body_bytes`: 413 past it), since HTTP /reset and /step parse theirs whole, and a
  request's head and its body must each arrive in time (`request_header_timeout_s`,
  `request_body_timeout_s`: 408 past them);
- how long a session lasts: a WebSocket session (/ws, /mcp) whose client sends no message for
  `session_idle_timeout_s` is ended (`SessionIdleTimeout`), so silent clients cannot hold every one of
  `max_sessions` slots; a WebSocket message past `max_body_bytes` closes its connection (1009, uvicorn's
  `ws_max_size`), as an HTTP body that large is refused;
- a /mcp request holding a lone surrogate (`"\\ud800"`, which has no UTF-8 form) is a 400
  (`LoneSurrogatesRefused`): openenv-core's route echoes its id into an answer it then cannot encode;
- a /ws client that leaves without OpenEnv's close message ends its session quietly
  (`QuietDisconnects`), not with uvicorn's traceback.
Cost: importing openenv-core's server takes ~6 s (it pulls in Gradio and fastmcp), once per server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketDisconnect

import inflight
from inflight.auth import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    check_api_keys,
    is_loopback,
    keys_from,
)
from inflight.connections import deadline_protocol, raise_open_files_limit
from inflight.envs import ENVS, make_env
from inflight.envs.base import Action, Environment, Observation, State, step_timeout
from inflight.envs.openenv_client import API_KEY_ENV
from inflight.errors import UserError

if TYPE_CHECKING:
    from fastapi import FastAPI


log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # open with keys too: what readiness probes and launchers poll
JSON_RPC_PATHS = frozenset({"/mcp"})  # openenv-core's HTTP JSON-RPC route: it echoes a request's id back
INPUT_QUOTED_CHARS = 200  # of a rejected input, in a 422: enough to recognise it, never a body's worth


class OpenEnvServerConfig(BaseModel):
    """How the server runs sessions; the env's own arguments go to `create_app` as keywords."""

    max_sessions: int = Field(default=256, ge=1)  # concurrent /ws sessions, one env (and thread) each
    # Accepted X-API-Key values; none: every route open (then `serve` listens on loopback only).
    api_keys: list[str] = Field(default_factory=list, repr=False)
    # An HTTP request body past this is refused (413) before it is parsed: /reset and /step read small JSON.
    max_body_bytes: int = Field(default=2**20, ge=1)
    # From a request's head to the end of its body (408 past it): uvicorn waits for a body forever, so a
    # client trickling one held its connection for good.
    request_body_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # From a connection's start (or a later request's first byte) to the end of a request's head, the /ws
    # handshake's included (408 past it; `inflight.connections`): a client that connected and sent nothing
    # held a connection and a file descriptor for good.
    request_header_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # Connections open at once, /ws sessions' included; one more is answered 503 and closed unread
    # (`inflight.connections`), so that a flood of them cannot take every file descriptor. None: derived
    # from the open-files limit (`connections.default_max_connections`).
    max_connections: int | None = Field(default=None, ge=1)
    # A WebSocket session whose client sends nothing this long while the server waits for its next message
    # is closed and its env and slot freed: a silent client held one of `max_sessions` for good.
    session_idle_timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)


class QuietDisconnects:
    """A /ws client that goes away without OpenEnv's close message (a plain `ws.close()`, a dropped
    connection) ends its session with one debug line. openenv-core's endpoint handles the disconnect, then
    closes the socket in its `finally`; that send to a client already gone raises WebSocketDisconnect again,
    outside its handler, and uvicorn logged it as "Exception in ASGI application" with a ~60-line traceback
    per session. Only that exception, and only on WebSocket scopes (/ws, /mcp), is absorbed; any other
    still propagates."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except WebSocketDisconnect as exc:
            log.debug("a %s client went away (close code %s)", scope["path"], exc.code)


class SessionIdleTimeout:
    """Ends a WebSocket session (/ws, /mcp) whose client sent no message for `idle_timeout_s` while the
    server waited for one; time the server spends on a message (a slow step) never counts. Each session
    holds one of `max_sessions` slots and its env until its socket closes, so clients that connect and
    then stay silent could hold every slot for good. openenv-core's own reaper (`session_timeout`) closes
    an idle session's env but leaves its socket open.

    Ordering contract: at the deadline the app is told the client left (a disconnect, as if it had), so
    openenv-core frees the session (`_destroy_session`) exactly as it does for a client that leaves, and only
    then closes the socket; that close is sent with `CLOSE_CODE` and a reason naming the limit. A client
    told of the close may therefore open another session at once."""

    CLOSE_CODE = 1001  # "going away": what WebSocket gateways (e.g. AWS API Gateway) send on an idle timeout

    def __init__(self, app: ASGIApp, idle_timeout_s: float) -> None:
        self.app = app
        self.idle_timeout_s = idle_timeout_s
        # At most 123 bytes (a close frame's limit).
        self.reason = f"idle timeout: no message for {idle_timeout_s:g} s (--session-idle-timeout-s)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        accepted = timed_out = closed = False

        async def receive_in_time() -> Message:
            nonlocal timed_out
            if not accepted:  # the handshake's own message, already there
                return await receive()
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    return await receive()  # cancelling uvicorn's receive (a queue's get) loses nothing
            except TimeoutError:
                timed_out = True
                log.info("closing an idle %s session: %s", scope["path"], self.reason)
                return {"type": "websocket.disconnect", "code": self.CLOSE_CODE, "reason": self.reason}

        async def send_noting(message: Message) -> None:
            nonlocal accepted, closed
            if message["type"] == "websocket.accept":
                accepted = True
            elif message["type"] == "websocket.close":
                closed = True
                if timed_out:
                    message = {**message, "code": self.CLOSE_CODE, "reason": self.reason}
            await send(message)

        await self.app(scope, receive_in_time, send_noting)
        if timed_out and not closed:  # an app that returns without closing: the client still hears why
            await send({"type": "websocket.close", "code": self.CLOSE_CODE, "reason": self.reason})


class LoneSurrogatesRefused:
    """400 for a request to `paths` (openenv-core's HTTP /mcp) whose JSON holds a lone surrogate: the JSON
    text `"\\ud800"` is well-formed but names no character, so the string has no UTF-8 form. openenv-core's
    route echoes the request's `id` (and its `method`, in some errors) into its answer, whose encoding then
    failed (FastAPI's `serialize_response`): a 500 and a traceback. The body read here is whole and bounded
    (it runs inside BodySizeLimitMiddleware); any other body, JSON or not, goes on unchanged."""

    def __init__(self, app: ASGIApp, paths: frozenset[str] = JSON_RPC_PATHS) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body: nobody to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _has_lone_surrogate(body):
            detail = (
                "the request's JSON holds a lone surrogate (an escape such as \\ud800 not part of a pair), "
                "which names no character: send only valid Unicode strings"
            )
            await AsciiJSONResponse(status_code=400, content={"detail": detail})(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class EnvRaised(RuntimeError):
    """The served env raised; the message names the original exception (logged with its traceback)."""


class NoEpisodeError(RuntimeError):
    """`step` before `reset`: over HTTP always, since each /step request gets a fresh environment."""


def environment_types(env_cls: type) -> tuple[type[Action], type[Observation], type[State]]:
    """The (Action, Observation, State) classes an Environment subclass declares as its type arguments,
    following generic subclasses (`class E(Base[MyObs])` where `Base(Environment[TextAction, ObsT, S])`).
    """
    found = _declared_args(env_cls, {})
    if found is None or not all(isinstance(t, type) for t in found):
        raise UserError(
            f"{env_cls.__name__} must declare its types, e.g. "
            f"class {env_cls.__name__}(Environment[TextAction, MyObservation, MyState]); found {found}"
        )
    act, obs, state = found
    return act, obs, state


def _declared_args(cls: type, bound: dict[Any, Any]) -> tuple[Any, ...] | None:
    # __orig_bases__ from the class's own __dict__: getattr would return an ancestor's.
    for base in cls.__dict__.get("__orig_bases__", cls.__bases__):
        origin = get_origin(base) or base
        args = tuple(bound.get(a, a) for a in get_args(base))
        if origin is Environment:
            return args
        if isinstance(origin, type) and issubclass(origin, Environment):
            params = getattr(origin, "__parameters__", ())
            if (found := _declared_args(origin, dict(zip(params, args, strict=False)))) is not None:
                return found
    return None


def create_app(name: str, config: OpenEnvServerConfig | None = None, **env_kwargs: Any) -> FastAPI:
    """An OpenEnv-protocol app serving `make_env(name, **env_kwargs)`, one env per /ws session.

    Builds one env up front, so an unknown name or bad arguments fail here rather than per session.
    """
    config = config or OpenEnvServerConfig()
    if name.startswith("openenv:"):
        raise UserError(
            f"{name!r} is a remote environment; serve a registered one: {', '.join(sorted(ENVS))}"
        )
    probe = make_env(name, **env_kwargs)
    try:
        action_cls, observation_cls, _ = environment_types(type(probe))
        description = (type(probe).__doc__ or name).strip().split("\n\n")[0]
    finally:
        probe.close()

    # Imported after the checks above: openenv-core's server takes seconds to import.
    from fastapi import Request
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.types import ConcurrencyConfig

    # A partial of the adapter class (not a closure) lets the server read the class's concurrency flags
    # without building a throwaway env.
    new_session_env = functools.partial(
        _adapter_class(), name, description, functools.partial(make_env, name, **env_kwargs)
    )
    # The server's type hints name openenv's own base classes; ours have the same fields and the server
    # only calls pydantic methods on them (see the module docstring).
    # No reaper: it closes an idle session's env but not its socket (SessionIdleTimeout ends both).
    sessions = ConcurrencyConfig(max_concurrent_envs=config.max_sessions, session_timeout=None)
    app = create_fastapi_app(
        new_session_env, cast(Any, action_cls), cast(Any, observation_cls), concurrency_config=sessions
    )
    app.title = f"inflight env {name} (OpenEnv protocol)"
    # `serve` gives uvicorn this protocol: a deadline on each request's head and a cap on open connections
    # (middleware can set neither).
    app.state.http_protocol = deadline_protocol(
        config.request_header_timeout_s, max_connections=config.max_connections
    )
    # Later added, earlier run: a /mcp body is bounded before LoneSurrogatesRefused reads it.
    app.add_middleware(LoneSurrogatesRefused)
    app.add_middleware(
        BodySizeLimitMiddleware, max_bytes=config.max_body_bytes, body_timeout_s=config.request_body_timeout_s
    )
    app.add_middleware(SessionIdleTimeout, idle_timeout_s=config.session_idle_timeout_s)
    app.add_middleware(QuietDisconnects)
    if config.api_keys:  # added last, so it runs first: no body of a request without a key is read
        keys = check_api_keys(config.api_keys)
        app.add_middleware(ApiKeyMiddleware, api_keys=keys, open_paths=OPEN_PATHS, bearer_paths=frozenset())

    # These only shape HTTP answers; /ws errors are already typed messages from openenv-core.
    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        errors = cast(ValidationError | RequestValidationError, exc).errors()
        return AsciiJSONResponse(status_code=422, content={"detail": jsonable_encoder(_clipped(errors))})

    async def user_error(request: Request, exc: Exception) -> JSONResponse:
        return AsciiJSONResponse(status_code=400, content={"detail": str(exc)})

    async def no_episode(request: Request, exc: Exception) -> JSONResponse:
        return AsciiJSONResponse(status_code=409, content={"detail": str(exc)})

    async def env_error(request: Request, exc: Exception) -> JSONResponse:
        detail = str(exc) if isinstance(exc, EnvRaised) else f"{type(exc).__name__}: {exc}"
        return AsciiJSONResponse(status_code=500, content={"detail": detail})

    app.add_exception_handler(ValidationError, invalid)
    app.add_exception_handler(RequestValidationError, invalid)  # FastAPI's own echoes the whole input
    app.add_exception_handler(UserError, user_error)
    app.add_exception_handler(NoEpisodeError, no_episode)
    app.add_exception_handler(EnvRaised, env_error)
    app.add_exception_handler(Exception, env_error)
    return app


def env_api_keys(flags: Sequence[str]) -> list[str]:
    """The keys the server accepts: the --api-key flags, else the one in $INFLIGHT_ENV_API_KEY (which
    inflight's client sends), else none (`auth.keys_from`)."""
    return keys_from(flags, API_KEY_ENV)


def check_env_listening(host: str, api_keys: Sequence[str]) -> None:
    """Beyond loopback, refuse to serve without a key: anyone who reaches the port plays the env, and
    `code`'s episodes run whatever they send (in its sandbox)."""
    if not api_keys and not is_loopback(host):
        raise UserError(
            f"refusing to serve an env on {host!r} without an API key: anyone who can reach it could play it "
            f"(and, for `code`, run programs in its sandbox). Set {API_KEY_ENV} (inflight's OpenEnv client "
            "sends it from there) or pass --api-key KEY, or bind 127.0.0.1"
        )


def serve(
    name: str,
    host: str = "127.0.0.1",
    port: int = 8200,
    config: OpenEnvServerConfig | None = None,
    **env_kwargs: Any,
) -> None:
    """Serve env `name` until interrupted (`inflight env serve NAME --port P`). The port is bound before
    openenv-core's slow import (a port in use fails at once, in one line) and the line printed names the
    port bound: `port=0` takes a free one. The open-files limit is raised first (`max_connections`' default
    is derived from it)."""
    from inflight.preflight import bind_port, serve_on

    config = config or OpenEnvServerConfig()
    check_env_listening(host, config.api_keys)
    raise_open_files_limit()
    with contextlib.closing(bind_port(host, port)) as sock:
        app = create_app(name, config, **env_kwargs)
        bound = sock.getsockname()[1]
        url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        print(f"inflight: serving env {name!r} with OpenEnv's protocol at {url} (/ws sessions)", flush=True)
        serve_on(
            sock,
            app,
            host,
            bound,
            log_level="warning",
            http=app.state.http_protocol,
            # A WebSocket message is bounded as an HTTP body is; past it uvicorn closes the connection (1009).
            ws_max_size=config.max_body_bytes,
        )


def _raised(name: str, method: str, error: Exception) -> EnvRaised:
    # A handled exception class: an unhandled one makes uvicorn close the keep-alive connection after the 500.
    log.warning("env %s raised in %s", name, method, exc_info=error)
    return EnvRaised(f"{type(error).__name__}: {error}")


class AsciiJSONResponse(JSONResponse):
    """JSON with every character past ASCII escaped: a lone surrogate an input smuggled in as "\\ud800",
    quoted back in a 422 or in a UserError's message, has no UTF-8 form and failed the answer (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _clipped(errors: Sequence[Any]) -> list[Any]:
    """pydantic's error list with each rejected input quoted up to INPUT_QUOTED_CHARS characters (as
    JSON): a 422 names what was wrong without sending a large body back. An input holding a number JSON
    cannot carry (NaN, or an infinity: `1e999` parses as one) is quoted as its text, which failed the
    answer (a 500) when sent as a number."""
    clipped = []
    for error in errors:
        if isinstance(error, dict) and "input" in error:
            quoted = json.dumps(error["input"], default=str)
            if len(quoted) > INPUT_QUOTED_CHARS:
                error = {**error, "input": f"{quoted[:INPUT_QUOTED_CHARS]}... ({len(quoted)} characters)"}
            elif not _finite(error["input"]):
                error = {**error, "input": quoted}
        clipped.append(error)
    return clipped


def _has_lone_surrogate(body: bytes) -> bool:
    """Whether `body` is JSON one of whose strings (or keys) has no UTF-8 form. Not JSON (or too deeply
    nested to parse): False, and the route answers it as it answers any bad body."""
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


def _finite(value: Any) -> bool:
    """Whether every number in `value` is one JSON can carry."""
    try:
        json.dumps(value, default=str, allow_nan=False)
    except ValueError:
        return False
    return True


def _invalid_reset(error: UserError, kwargs: dict[str, Any]) -> ValidationError:
    """A UserError from `reset` as pydantic's ValidationError: /ws answers it with VALIDATION_ERROR."""
    detail = {
        "type": PydanticCustomError("invalid_reset", "{reason}", {"reason": str(error)}),
        "input": kwargs,
    }
    return ValidationError.from_exception_data("reset", [cast(Any, detail | {"loc": ()})])


@functools.cache
def _adapter_class() -> type:
    """Built on first use: subclassing openenv's Environment imports openenv-core's server (~6 s)."""
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
    from openenv.core.env_server.types import EnvironmentMetadata, ResetRequest
    from openenv.core.env_server.types import State as OpenEnvState

    class ServedEnv(OpenEnvEnvironment):  # type: ignore[misc]
        """One inflight env behind openenv-core's server; one instance per session or HTTP request."""

        # Each session gets its own instance and they share nothing, so the server may run many.
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(
            self, name: str, description: str, make: Callable[[], Environment[Any, Any, Any]]
        ) -> None:
            super().__init__()
            self.name, self.description, self.env = name, description, make()
            self.started = False

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
            # Raises pydantic's ValidationError, which the /ws channel answers with VALIDATION_ERROR.
            ResetRequest.model_validate({"seed": seed, "episode_id": episode_id})
            try:
                obs = self.env.reset(seed=seed, episode_id=episode_id, **kwargs)
            except UserError as e:  # bad reset arguments: the client's error, like a bad seed
                raise _invalid_reset(e, kwargs) from e
            except Exception as e:
                raise _raised(self.name, "reset", e) from e
            self.started = True
            return obs

        def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            if not self.started:
                raise NoEpisodeError(
                    f"no {self.name} episode in progress: reset first. HTTP /step is stateless in OpenEnv's "
                    "protocol (every request gets a fresh environment); play episodes over the /ws session"
                )
            try:
                # An env written against the older `step(self, action)` is served too, unbounded.
                return self.env.step(action, **step_timeout(self.env, timeout_s), **kwargs)
            except UserError:
                raise
            except Exception as e:
                raise _raised(self.name, "step", e) from e

        @property
        def state(self) -> Any:
            return OpenEnvState.model_validate(self.env.state.model_dump())

        def get_metadata(self) -> Any:
            return EnvironmentMetadata(
                name=self.name, description=self.description, version=f"inflight {inflight.__version__}"
            )

        def close(self) -> None:
            self.env.close()

    return ServedEnv
