"""Any OpenEnv-protocol server as an inflight Env (`env.name=openenv:http://host:port`): one /ws session
per env, observations mapped to `TextObservation`s. Knows the wire protocol; nothing of what is served.

Design decision: a synchronous client on `websockets.sync` rather than openenv-core's `EnvClient`.
Our Env API is synchronous and a run holds one env per episode in flight (hundreds at once).
openenv-core's client is async; its `.sync()` wrapper runs an event loop thread per client, turns
the server's typed errors into a plain RuntimeError string, and importing it takes ~6 s (Gradio).
The protocol it speaks is four small JSON messages (`reset`, `step`, `state`, `close`) answered by
`observation`, `state` or `error` messages with a code; tests/test_openenv_interop.py plays this
client against openenv-core's own server, so compliance is checked against the real thing.

A server with an API key (`inflight env serve --api-key`) gets the key in $INFLIGHT_ENV_API_KEY as
X-API-Key, on the /ws handshake and on /schema. From the environment rather than a config key: a run's
config (env.kwargs included) is saved as config.json in its run directory, and command lines are readable
by every local user.

Errors: an env that raises on the server (EXECUTION_ERROR) ends the episode with a done observation
(reward `error_reward`, `metadata["env_error"] = 1`), counted in `counters["env_errors"]`, and the
next `reset` works. A malformed request (VALIDATION_ERROR: wrong `action_field`, bad reset
arguments) is our bug and raises `UserError`; a server that cannot be reached, answers too late,
refuses the session (CAPACITY_REACHED) or closes it raises `OpenEnvError`, naming the URL.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import weakref
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from inflight.envs.base import Action, Environment, State, TextAction, TextObservation
from inflight.errors import UserError

API_KEY_ENV = "INFLIGHT_ENV_API_KEY"  # the key this client sends, and `inflight env serve` accepts
API_KEY_HEADER = "X-API-Key"
# Codes of openenv-core's `WSErrorCode` (env_server/types.py): after these the session still lives.
_ENV_FAILED = "EXECUTION_ERROR"
_BAD_REQUEST = {"VALIDATION_ERROR", "INVALID_JSON", "UNKNOWN_TYPE"}


class OpenEnvError(ConnectionError):
    """The remote server could not be used: unreachable, too slow, full, or it closed the session."""


class OpenEnvClientConfig(BaseModel):
    """How to talk to one server; `make_env("openenv:URL", **kwargs)` passes kwargs here."""

    model_config = ConfigDict(extra="forbid")

    url: str  # http(s):// or ws(s):// base URL of the server, without /ws
    # Observation field holding the text the policy reads; None: `prompt` when the server sends one,
    # else every field as JSON (so the policy still sees everything the server sent).
    prompt_field: str | None = None
    # Action field the generated text goes into; None: read /schema and take the action's one
    # required string field (e.g. `text` for inflight envs, `message` for OpenEnv's echo env).
    action_field: str | None = None
    error_reward: float = 0.0  # reward of an episode the server's env ended by raising
    connect_timeout_s: float = Field(default=10.0, gt=0)
    message_timeout_s: float = Field(default=60.0, gt=0)  # one reset or step, including the env's work
    max_message_bytes: int = Field(default=64 * 2**20, gt=0)


class RemoteObservation(TextObservation):
    """A remote server's observation: `prompt` for the policy, and every field as sent in `fields`.

    Each field also reads as an attribute (`obs.legal_actions`, `obs.player_total`), so that code written
    against a local env's observation (a task's reward, the warm-up's legal actions) reads a remote one
    alike. The declared attributes come first: `prompt`, `done` and `reward` are this client's."""

    fields: dict[str, Any] = Field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only for names that normal lookup did not find. `fields` from __dict__: a model being built or
        # copied has none yet, and `self.fields` would come back here.
        fields = self.__dict__.get("fields")
        if fields is not None and name in fields and not name.startswith("_"):
            return fields[name]
        return super().__getattr__(name)  # type: ignore[misc]  # pydantic's (typing hides it)


class OpenEnvClientEnv(Environment[Action, RemoteObservation, State]):
    """Plays a remote OpenEnv server over its /ws session. Connects on the first `reset`; one episode at
    a time, like any Env. `close()` ends the session (dropping the env does too)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.config = OpenEnvClientConfig(url=url, **kwargs)
        self.http_url, self.ws_url = _endpoints(self.config.url)
        self._action_field = self.config.action_field
        self._ws: Any = None  # websockets.sync.client.ClientConnection once connected
        self._close_ws: weakref.finalize | None = None
        self._in_episode = False
        self._episode_id: str | None = None
        self._steps = 0
        self._counters = {"episodes": 0, "steps": 0, "env_errors": 0}

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> RemoteObservation:
        data = {k: v for k, v in dict(seed=seed, episode_id=episode_id).items() if v is not None}
        if self._ws is not None and _is_closed(self._ws):
            self._drop()  # the server ended the session (e.g. it restarted); a new episode opens a new one
        self._episode_id, self._steps, self._in_episode = episode_id, 0, False
        self._counters["episodes"] += 1
        return self._exchange({"type": "reset", "data": data | kwargs})

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> RemoteObservation:
        if not self._in_episode:
            raise RuntimeError(f"OpenEnvClientEnv({self.http_url}).step called before reset() or after done")
        if isinstance(action, TextAction):
            data = {self._resolve_action_field(): action.text}
        else:  # a structured action: its fields are the server's action fields
            data = action.model_dump(exclude={"metadata"})
        self._steps += 1
        self._counters["steps"] += 1
        return self._exchange({"type": "step", "data": data}, timeout_s)

    @property
    def state(self) -> State:
        """The server's state of this session (it may include hidden information)."""
        if self._ws is None:
            return State(episode_id=self._episode_id, step_count=self._steps)
        answer = self._request({"type": "state"})
        return State.model_validate(answer["data"])

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def close(self) -> None:
        """End the session politely: the server closes its env and then the socket."""
        if self._close_ws is not None:
            self._close_ws()
        self._ws = self._close_ws = None
        self._in_episode = False

    def _drop(self) -> None:
        """Close the socket at once: after a timeout or a protocol error nothing more is awaited."""
        if self._close_ws is not None and self._close_ws.detach() is not None:
            with contextlib.suppress(Exception):
                self._ws.close()
        self._ws = self._close_ws = None
        self._in_episode = False

    def _exchange(self, message: dict[str, Any], timeout_s: float | None = None) -> RemoteObservation:
        """Send a reset or step; an env that raised on the server ends the episode, counted."""
        try:
            answer = self._request(message, timeout_s)
        except _EnvFailed as e:
            self._in_episode = False
            self._counters["env_errors"] += 1
            return RemoteObservation(
                prompt=f"Environment error: {e}",
                done=True,
                reward=self.config.error_reward,
                metadata={"env_error": 1},
            )
        if answer.get("type") != "observation" or not isinstance(answer.get("data"), dict):
            self._drop()
            raise OpenEnvError(f"{self.ws_url} answered a {message['type']} with {_clip(answer)}")
        obs = self._observation(answer["data"])
        self._in_episode = not obs.done
        return obs

    def _observation(self, data: dict[str, Any]) -> RemoteObservation:
        fields = data.get("observation")
        if not isinstance(fields, dict):
            raise OpenEnvError(
                f"{self.ws_url} sent an observation without an `observation` object: {_clip(data)}"
            )
        key = self.config.prompt_field
        if key is not None and key not in fields:
            raise UserError(
                f"{self.http_url} observations have no field {key!r} (prompt_field); got {sorted(fields)}"
            )
        key = key or ("prompt" if "prompt" in fields else None)
        value = fields[key] if key is not None else fields
        prompt = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        reward = data.get("reward")
        return RemoteObservation(
            prompt=prompt,
            fields=fields,
            done=bool(data.get("done", False)),
            reward=None if reward is None else float(reward),
        )

    def _request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One message and its answer, waiting at most message_timeout_s, or `timeout_s` (a step's: the
        seconds its episode has left) when that is shorter. OpenEnv's /ws step carries no timeout, so the
        server's env cannot be told: the wait is what this side bounds."""
        from websockets.exceptions import ConnectionClosed

        wait_s, bound = self.config.message_timeout_s, "message_timeout_s"
        if timeout_s is not None and timeout_s < wait_s:
            wait_s, bound = timeout_s, "the step's timeout_s"
        ws = self._connection()
        try:
            ws.send(json.dumps(message))
            raw = ws.recv(timeout=wait_s)
        except TimeoutError as e:
            # A late answer would be read as the answer to the next message: this session is unusable.
            self._drop()
            raise OpenEnvError(
                f"no answer from {self.ws_url} to {message['type']} within {wait_s:g} s ({bound})"
            ) from e
        except ConnectionClosed as e:
            # A server that refuses a session (CAPACITY_REACHED) says why and closes at once, maybe
            # before our message went out: its last words are still queued.
            raw = _last_message(ws)
            if raw is None:
                self._drop()
                raise OpenEnvError(f"{self.ws_url} closed the session during {message['type']}: {e}") from e
        try:
            answer = json.loads(raw)
        except json.JSONDecodeError as e:
            self._drop()
            raise OpenEnvError(
                f"{self.ws_url} answered {message['type']} with invalid JSON: {_clip(raw)}"
            ) from e
        if not isinstance(answer, dict):
            self._drop()
            raise OpenEnvError(f"{self.ws_url} answered {message['type']} with {_clip(answer)}")
        if answer.get("type") == "error":
            self._raise_error(message["type"], answer.get("data") or {})
        return answer

    def _raise_error(self, request: str, error: dict[str, Any]) -> None:
        code, text = error.get("code", "UNKNOWN"), error.get("message", "")
        if code == _ENV_FAILED:
            raise _EnvFailed(f"{code}: {text}")
        if code in _BAD_REQUEST:
            details = f"; {error['errors']}" if "errors" in error else ""
            raise UserError(f"{self.ws_url} rejected our {request} ({code}): {text}{details}")
        self._drop()  # CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR: the server has ended this session
        hint = " (the server's session limit; serve with more sessions)" if code == "CAPACITY_REACHED" else ""
        raise OpenEnvError(f"{self.ws_url} refused the {request} with {code}: {text}{hint}")

    def _connection(self) -> Any:
        if self._ws is not None:
            return self._ws
        from websockets.exceptions import InvalidStatus, WebSocketException
        from websockets.sync.client import connect

        try:
            ws = connect(
                self.ws_url,
                additional_headers=_key_header(),
                open_timeout=self.config.connect_timeout_s,
                close_timeout=self.config.connect_timeout_s,
                max_size=self.config.max_message_bytes,
                # An HTTP(S)_PROXY from the environment must not capture loopback traffic.
                proxy=None if _is_loopback(self.ws_url) else True,
            )
        except (OSError, WebSocketException) as e:  # refused, timed out, not a /ws endpoint
            refused = isinstance(e, InvalidStatus) and e.response.status_code in (401, 403)
            hint = f"; a server with an API key wants it in {API_KEY_ENV}" if refused else ""
            raise OpenEnvError(
                f"cannot open an OpenEnv session at {self.ws_url} "
                f"(within connect_timeout_s={self.config.connect_timeout_s}): {e}{hint}"
            ) from e
        # websockets >= 17.1 warns when a connection is used outside `with`; entering it is all `with`
        # does at the start, and close() below is the exit.
        self._ws = ws.__enter__()
        # Closes the socket (and the server's session) when this env is dropped without close():
        # the loops build one env per episode and may not close them.
        self._close_ws = weakref.finalize(self, _close_quietly, ws, min(self.config.connect_timeout_s, 5.0))
        return ws

    def _resolve_action_field(self) -> str:
        if self._action_field is None:
            self._action_field = _text_field(self.http_url, self.config.connect_timeout_s)
        return self._action_field


class _EnvFailed(Exception):
    """The server's env raised (EXECUTION_ERROR); the session lives on."""


def _endpoints(url: str) -> tuple[str, str]:
    """(http base URL, ws URL of the session channel) for a server's base URL."""
    parts = urlsplit(url.rstrip("/"))
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise UserError(
            f"OpenEnv server URL {url!r} must look like http://host:port (or ws://, https://, wss://)"
        )
    path = parts.path.removesuffix("/ws")
    http = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return f"{http}://{parts.netloc}{path}", f"{schemes[parts.scheme]}://{parts.netloc}{path}/ws"


@functools.lru_cache(maxsize=64)
def _text_field(http_url: str, timeout_s: float) -> str:
    """The action's one required string field, read from the server's /schema. Cached per server: a
    run builds an env per episode (failures are not cached)."""
    import httpx

    try:
        response = httpx.get(
            f"{http_url}/schema",
            headers=_key_header(),
            timeout=timeout_s,
            trust_env=not _is_loopback(http_url),
        )
        response.raise_for_status()
        schema = response.json()["action"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise OpenEnvError(f"cannot read the action schema from {http_url}/schema: {e}") from e
    props = schema.get("properties", {})
    text = [k for k in schema.get("required", []) if props.get(k, {}).get("type") == "string"]
    if len(text) != 1:
        raise UserError(
            f"{http_url}'s action has {len(text)} required string fields {text} (of {sorted(props)}); "
            "pass action_field=NAME to say which one the generated text goes into"
        )
    return text[0]


def _key_header() -> dict[str, str]:
    key = os.environ.get(API_KEY_ENV, "").strip()
    return {API_KEY_HEADER: key} if key else {}


def _last_message(ws: Any) -> str | None:
    """A message that arrived before the connection closed, if any."""
    from websockets.exceptions import ConnectionClosed

    try:
        return str(ws.recv(timeout=0))
    except (ConnectionClosed, TimeoutError):
        return None


def _is_closed(ws: Any) -> bool:
    from websockets.protocol import State as ConnectionState

    return bool(ws.protocol.state is ConnectionState.CLOSED)


def _is_loopback(url: str) -> bool:
    return urlsplit(url).hostname in ("localhost", "127.0.0.1", "::1")


def _close_quietly(ws: Any, wait_s: float) -> None:
    """Ask the server to end the session and wait (at most `wait_s`) for it to close the socket first:
    openenv-core logs a traceback for every client that closes under it."""
    from websockets.exceptions import ConnectionClosed

    deadline = time.monotonic() + wait_s
    try:
        ws.send(json.dumps({"type": "close"}))
        while (left_s := deadline - time.monotonic()) > 0:
            ws.recv(timeout=left_s)  # a late answer to an abandoned request, if any
    except (ConnectionClosed, TimeoutError, OSError):
        pass  # closed by the server (the normal end), too slow, or gone already
    finally:
        with contextlib.suppress(Exception):
            ws.close()


def _clip(value: Any, max_chars: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."
