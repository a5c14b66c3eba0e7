"""`inflight env serve`: bad input is one line and exit 2 before anything listens (a port out of range, in
use or unresolvable, a session limit below 1, a public bind without a key, a blank key); the line printed
names the port bound (`--port 0`); with a key every route but /health, the /ws handshake included, needs it,
which inflight's OpenEnv client sends from $INFLIGHT_ENV_API_KEY (openenv-core's own client sends no
headers); request bodies are bounded (413) and a 422 never echoes a large input, and /ws messages by the same
bound (1009); a /ws client that leaves without OpenEnv's close message costs the log no traceback; a silent
/ws session is closed after `--session-idle-timeout-s`, freeing its slot; a /mcp request holding a lone
surrogate is a 400, not a 500.

Reference: the QA pass on `env serve` (`--port 70000` printed one port and listened on another, `--port 0`
printed `:0`, a port in use printed "serving" then a uvicorn error, `--max-sessions 0` a traceback, a public
bind needed no key, and a 50 MB /reset body came back whole in the 422), its "Not promised" list in
docs/security.md (no idle timeout, 16 MiB /ws messages, a 500 from /mcp), and `inflight serve-engine`,
whose checks these mirror.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from conftest import one_line_error
from inflight.envs import TextAction
from inflight.envs.openenv_client import OpenEnvClientEnv, OpenEnvError
from inflight.errors import UserError

KEY = "a-key-for-the-tests"
API_KEY_ENV = "INFLIGHT_ENV_API_KEY"  # as documented (docs/environments.md, docs/security.md)
START_TIMEOUT_S = 120.0  # a cold server imports openenv-core (Gradio): seconds, more on a loaded machine
IDLE_TIMEOUT_S = 1.0  # --session-idle-timeout-s of `one_session_server`
MAX_BODY_BYTES = 2**20  # OpenEnvServerConfig.max_body_bytes's default: HTTP bodies and /ws messages


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting uvicorn fail the test: bad input must be reported before anything serves."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("uvicorn started serving before the bad input was reported")

    monkeypatch.setattr("uvicorn.run", refuse)
    monkeypatch.setattr("uvicorn.Server.run", refuse)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--port", "70000"], "--port 70000 is out of range"),
        (["--host", "256.1.1.1", "--api-key", KEY], "cannot listen on 256.1.1.1:8200"),
        (["--max-sessions", "0"], "--max-sessions must be >= 1, got 0"),
        (["--max-sessions", "-3"], "--max-sessions must be >= 1, got -3"),
        (["--host", "0.0.0.0"], "refusing to serve an env on '0.0.0.0' without an API key"),
        (["--api-key", " "], "API key #1 is empty or blank"),
    ],
)
def test_bad_input_is_one_line_before_anything_serves(
    capsys: pytest.CaptureFixture[str], no_serving: None, flags: list[str], expected: str
) -> None:
    line = one_line_error(capsys, "env", "serve", "blackjack", *flags)
    assert expected in line, line


def test_a_port_in_use_is_one_line(
    capsys: pytest.CaptureFixture[str], no_serving: None, busy_port: int
) -> None:
    line = one_line_error(capsys, "env", "serve", "blackjack", "--port", str(busy_port))
    assert f"port {busy_port} on 127.0.0.1 is in use" in line, line


def test_the_key_comes_from_the_flags_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from inflight.envs.openenv_server import check_env_listening, env_api_keys

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert env_api_keys([]) == []
    with pytest.raises(UserError, match="without an API key"):
        check_env_listening("0.0.0.0", [])
    check_env_listening("localhost", [])  # loopback: a key is optional
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert env_api_keys([]) == [KEY] and env_api_keys(["flag"]) == ["flag"]
    check_env_listening("0.0.0.0", env_api_keys([]))
    monkeypatch.setenv(API_KEY_ENV, "  ")
    with pytest.raises(UserError, match=f"{API_KEY_ENV} is set but blank"):
        env_api_keys([])


@dataclass(frozen=True)
class Served:
    url: str  # from the line the server prints
    log: Path  # its stdout and stderr


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`inflight env serve blackjack --port 0 --api-key KEY`, as a user starts it; its URL from the line it
    prints."""
    with _serving(tmp_path_factory, "--api-key", KEY) as served:
        yield served


@pytest.fixture(scope="module")
def one_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`inflight env serve blackjack --port 0 --max-sessions 1 --session-idle-timeout-s 1`, on loopback
    without a key: one silent client would hold the only slot."""
    flags = ["--max-sessions", "1", "--session-idle-timeout-s", f"{IDLE_TIMEOUT_S:g}"]
    with _serving(tmp_path_factory, *flags) as served:
        yield served


@contextlib.contextmanager
def _serving(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[Served]:
    """`inflight env serve blackjack --port 0 FLAGS` in a subprocess, until the block ends."""
    log = tmp_path_factory.mktemp("env-serve") / "server.log"
    cmd = [sys.executable, "-m", "inflight.cli", "env", "serve", "blackjack", "--port", "0", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"}
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (found := re.search(r"at (http://127\.0\.0\.1:(\d+)) \(/ws sessions\)", log.read_text())):
            assert proc.poll() is None, (
                f"`inflight env serve` exited with code {proc.returncode}: {log.read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"no serving line within {START_TIMEOUT_S} s: {log.read_text()}"
            )
            time.sleep(0.1)
        url, port = found.group(1), int(found.group(2))
        assert port != 0
        while True:  # listening already (bound before the line); answering once openenv-core is imported
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield Served(url, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def keyed_url(keyed_server: Served) -> str:
    return keyed_server.url


def test_with_a_key_every_route_but_health_and_the_ws_handshake_need_it(keyed_url: str) -> None:
    with httpx.Client(base_url=keyed_url, trust_env=False) as http:
        assert http.get("/health").status_code == 200
        for path in ("/schema", "/metadata", "/state"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"X-API-Key": "wrong"}).status_code == 401, path
        assert http.get("/schema", headers={"X-API-Key": KEY}).status_code == 200
        assert http.post("/reset", json={"seed": 1}).status_code == 401
    ws_url = keyed_url.replace("http://", "ws://") + "/ws"
    with pytest.raises(InvalidStatus, match="HTTP 401"):
        connect(ws_url, open_timeout=10)
    with connect(ws_url, open_timeout=10, additional_headers={"X-API-Key": KEY}) as ws:
        ws.send('{"type": "reset", "data": {"seed": 1}}')
        assert '"observation"' in str(ws.recv(timeout=10))


def test_inflights_client_sends_the_key_from_the_environment(
    keyed_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(OpenEnvError, match=f"HTTP 401; a server with an API key wants it in {API_KEY_ENV}"):
        OpenEnvClientEnv(keyed_url).reset(seed=1)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    env = OpenEnvClientEnv(keyed_url)  # the action field comes from /schema: read with the key too
    obs = env.reset(seed=1)
    assert obs.legal_actions == ["hit", "stand"]
    assert env.step(TextAction(text="stand")).done
    env.close()


def test_openenv_cores_generic_client_cannot_send_a_key(keyed_url: str) -> None:
    """Why docs/environments.md says a keyed server needs inflight's client (or loopback): openenv-core
    0.3.0's EnvClient opens its socket with no way to add a header."""
    from openenv.core import GenericEnvClient

    with pytest.raises(ConnectionError, match="401"), GenericEnvClient(base_url=keyed_url).sync() as client:
        client.reset(seed=1)


def test_request_bodies_are_bounded_and_a_422_quotes_little_of_its_input(keyed_url: str) -> None:
    headers = {"X-API-Key": KEY, "content-type": "application/json"}
    with httpx.Client(base_url=keyed_url, trust_env=False, headers=headers, timeout=60) as http:
        big = http.post("/reset", content=b'{"seed": "' + b"x" * 50_000_000 + b'"}')
        assert big.status_code == 413 and "limit of 1048576 bytes" in big.json()["detail"]
        for body in ({"seed": "x" * 500_000}, {"seed": 1, "extra": "y" * 500_000}):
            answer = http.post("/reset", json=body)
            assert answer.status_code == 422 and len(answer.content) < 2_000, answer.text[:300]
            error = answer.json()["detail"][0]
            assert error["input"].endswith("characters)") and "..." in error["input"], error
        small = http.post("/reset", json={"seed": "abc"})  # a small input is quoted as it came
        assert small.status_code == 422 and small.json()["detail"][0]["input"] == "abc"


def test_a_client_that_leaves_without_openenvs_close_message_costs_no_traceback(keyed_server: Served) -> None:
    """A /ws client that ends with a plain close (no `{"type": "close"}` first), or drops the connection,
    used to cost a ~60-line "Exception in ASGI application ... WebSocketDisconnect" traceback in the
    server's log per session: openenv-core's endpoint closes the socket again in its `finally`. Now such a
    disconnect logs nothing at the server's level (warnings), and the server goes on serving."""
    ws_url = keyed_server.url.replace("http://", "ws://") + "/ws"
    headers = {"X-API-Key": KEY}
    logged_before = len(keyed_server.log.read_text())
    for ending in ("close", "drop"):
        with connect(ws_url, open_timeout=10, additional_headers=headers) as ws:
            ws.send('{"type": "reset", "data": {"seed": 1}}')
            assert '"observation"' in str(ws.recv(timeout=10))
            if ending == "drop":
                ws.socket.close()  # no close frame at all
        # else the block's end sent a close frame, without OpenEnv's close message
    deadline = time.monotonic() + 5  # the traceback came within milliseconds of the disconnect
    while time.monotonic() < deadline and "Traceback" not in keyed_server.log.read_text()[logged_before:]:
        time.sleep(0.1)
    logged = keyed_server.log.read_text()[logged_before:]
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged
    assert len(logged.splitlines()) <= 2, logged  # at most one short line per disconnect
    with connect(ws_url, open_timeout=10, additional_headers=headers) as ws:  # still serving
        ws.send('{"type": "reset", "data": {"seed": 2}}')
        assert '"observation"' in str(ws.recv(timeout=10))


def test_no_input_quoted_back_makes_an_answer_fail(keyed_url: str) -> None:
    """A 422 quoting an input that holds NaN or an infinity (`1e999` parses as one), or an answer whose
    message holds a lone surrogate ("\\ud800" in the input's JSON), failed as it was written: a 500 and a
    traceback in the server's log. Now such an input is quoted as its text, and surrogates escaped."""
    headers = {"X-API-Key": KEY, "content-type": "application/json"}
    cases = [
        ("/reset", '{"seed": NaN}', "NaN"),
        ("/reset", '{"seed": 1e999}', "Infinity"),
        ("/reset", '{"seed": 1, "cards": [Infinity]}', "Infinity"),
        ("/reset", '{"seed": 1, "cards": "\\ud800"}', "\\ud800"),
        ("/reset", '{"episode_id": "\\ud800"}', "\\ud800"),
        ("/step", '{"action": {"text": "hit"}, "timeout_s": NaN}', "NaN"),
    ]
    with httpx.Client(base_url=keyed_url, trust_env=False, headers=headers, timeout=60) as http:
        for path, body, quoted in cases:
            answer = http.post(path, content=body)
            assert answer.status_code == 422 and answer.content.isascii(), (body, answer.text)
            strict = json.loads(answer.text, parse_constant=lambda word: pytest.fail(f"{word} is not JSON"))
            [error] = strict["detail"]
            assert quoted in json.dumps(error["input"]), (body, error)
        assert http.post("/reset", json={"seed": 1}).status_code == 200


def test_a_silent_ws_session_is_closed_and_its_slot_freed(one_session_server: Served) -> None:
    """With --max-sessions 1, one client that opened a /ws session and then sent nothing held the only slot
    for good: nobody else could play. Now the server closes a session whose client sends no message for
    --session-idle-timeout-s (1 s here), with code 1001 and a reason naming the option, after freeing its
    slot, so a new session plays at once. A session that keeps sending is never closed."""
    ws_url = one_session_server.url.replace("http://", "ws://") + "/ws"
    logged_before = len(one_session_server.log.read_text())
    with connect(ws_url, open_timeout=10) as talking:
        talking.send('{"type": "reset", "data": {"seed": 1}}')
        assert '"observation"' in str(talking.recv(timeout=10))
        talking_since = time.monotonic()
        while time.monotonic() - talking_since < 3 * IDLE_TIMEOUT_S:  # three timeouts' worth, never idle 1 s
            time.sleep(IDLE_TIMEOUT_S / 4)
            talking.send('{"type": "state"}')
            assert json.loads(talking.recv(timeout=10))["type"] == "state"
        talking.send('{"type": "close"}')  # OpenEnv's close: the server frees the session, then closes
        with pytest.raises(ConnectionClosed) as ended:
            talking.recv(timeout=10)
        assert ended.value.rcvd is not None and ended.value.rcvd.code == 1000, ended.value
    with connect(ws_url, open_timeout=10) as silent:  # never sends a message
        silent_since = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            silent.recv(timeout=IDLE_TIMEOUT_S + 20)
        waited_s = time.monotonic() - silent_since
    assert closed.value.rcvd is not None, closed.value
    assert closed.value.rcvd.code == 1001 and "--session-idle-timeout-s" in closed.value.rcvd.reason
    assert "idle timeout" in closed.value.rcvd.reason and waited_s > IDLE_TIMEOUT_S / 2, (
        closed.value,
        waited_s,
    )
    with connect(ws_url, open_timeout=10) as next_client:  # the only slot is free already: no retry
        next_client.send('{"type": "reset", "data": {"seed": 2}}')
        assert '"observation"' in str(next_client.recv(timeout=10))
        next_client.send('{"type": "close"}')
        with pytest.raises(ConnectionClosed):
            next_client.recv(timeout=10)
    logged = one_session_server.log.read_text()[logged_before:]
    assert "Traceback" not in logged, logged


def test_a_ws_message_over_the_body_limit_closes_only_its_connection(keyed_server: Served) -> None:
    """A /ws message could be as large as uvicorn's 16 MiB, 16 times what an HTTP body may be. Now one past
    `max_body_bytes` (1 MiB) closes its connection with 1009 (message too big); one at the bound is read,
    and the server's other sessions play on."""
    ws_url = keyed_server.url.replace("http://", "ws://") + "/ws"
    headers = {"X-API-Key": KEY}
    logged_before = len(keyed_server.log.read_text())
    with connect(ws_url, open_timeout=10, additional_headers=headers) as other:
        other.send('{"type": "reset", "data": {"seed": 1}}')
        assert '"observation"' in str(other.recv(timeout=10))
        other.send("x" * MAX_BODY_BYTES)  # at the bound: read, and answered (it is not JSON)
        assert "INVALID_JSON" in str(other.recv(timeout=30))
        with connect(ws_url, open_timeout=10, additional_headers=headers) as big:
            big.send("x" * (MAX_BODY_BYTES + 1))
            with pytest.raises(ConnectionClosed) as closed:
                big.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
        other.send('{"type": "step", "data": {"text": "stand"}}')
        assert '"observation"' in str(other.recv(timeout=10))
    logged = keyed_server.log.read_text()[logged_before:]
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged


def test_a_mcp_request_holding_a_lone_surrogate_is_a_400(keyed_server: Served) -> None:
    """openenv-core's /mcp echoes a JSON-RPC request's id (and, in some errors, its method) into its answer;
    one holding a lone surrogate (the JSON text "\\ud800": well-formed, but no character) could not be
    encoded: a 500 and a traceback in the server's log. Now such a request is a 400 that says why, in ASCII
    JSON; valid non-ASCII strings (a surrogate pair among them) still pass."""
    headers = {"X-API-Key": KEY, "content-type": "application/json"}
    logged_before = len(keyed_server.log.read_text())
    with httpx.Client(base_url=keyed_server.url, trust_env=False, headers=headers, timeout=60) as http:
        for body in (
            '{"jsonrpc": "2.0", "id": "\\ud800", "method": "tools/list"}',
            '{"jsonrpc": "2.0", "id": 1, "method": "\\udfff"}',
        ):
            answer = http.post("/mcp", content=body)
            assert answer.status_code == 400 and answer.content.isascii(), (body, answer.text)
            assert "lone surrogate" in answer.json()["detail"], answer.text
        for body, echoed in (
            ('{"jsonrpc": "2.0", "id": "\\u00e9", "method": "tools/list"}', "\u00e9"),
            ('{"jsonrpc": "2.0", "id": "\\ud83d\\ude00", "method": "tools/list"}', "\U0001f600"),
        ):
            answer = http.post("/mcp", content=body)
            assert answer.status_code == 200 and answer.json()["id"] == echoed, (body, answer.text)
    logged = keyed_server.log.read_text()[logged_before:]
    assert "Traceback" not in logged, logged
