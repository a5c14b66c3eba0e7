"""`inflight serve-engine` and `inflight env serve` bound every request's head and body, in time and in size,
as `inflight serve` does (`inflight.connections`, `auth.py`'s BodySizeLimitMiddleware), and the connections
open at once (`--max-connections`: a 503 past it), after raising the open-files limit, as all three do.

Reference: the hostile-input pass over both servers (a connection that sent nothing, or trickled its head or
its body, was held for good; a 145 MB header was taken in, stalling the event loop for seconds at a time;
the engine read and parsed JSON bodies of any size, and a chunked update body of any size; connections
were bounded only by the file descriptors, often 1,024, which a flood took from the server's own files),
and `tests/test_api_header_timeout.py`, which holds the same head deadline and cap for `inflight serve`.
Real sockets against the real apps and protocol in-thread on loopback; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import torch
import uvicorn
from websockets.sync.client import connect as ws_connect

import inflight.envs.openenv_server
import inflight.inference.serve_engine
from conftest import assert_refused_at_once, read_until_closed
from inflight.auth import BodySizeLimitMiddleware
from inflight.cli import main
from inflight.connections import MAX_HEAD_BYTES, default_max_connections
from inflight.envs.openenv_server import OpenEnvServerConfig
from inflight.envs.openenv_server import create_app as create_env_app
from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.engine_service import EngineServerConfig
from inflight.inference.server import ServerThread
from inflight.inference.server import create_app as create_engine_app
from inflight.models import load_model, load_tokenizer

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
WAIT_S = 10.0  # the most any one read waits: a test that would hang fails instead
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
MAX_CONNECTIONS = 3
# The capped server's head deadline: past the steps a test takes before it, short enough to wait out.
CAPPED_HEADER_TIMEOUT_S = 5.0
# How long a slot may take to free after its connection closed (the server sees the close a moment after
# the client makes it): well within the head's deadline, so that no slot freed by that deadline counts.
SLOT_FREED_WITHIN_S = CAPPED_HEADER_TIMEOUT_S / 2


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores
    engine = BuiltinEngine(
        load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), BuiltinEngineConfig(max_seq_len_tokens=64)
    )
    config = EngineServerConfig(
        request_header_timeout_s=HEADER_TIMEOUT_S,
        request_body_timeout_s=BODY_TIMEOUT_S,
        max_body_bytes=2**20,
        max_update_bytes=2 * 2**20,
    )
    server = ServerThread(create_engine_app(engine, load_tokenizer(tiny_model_dir), config)).start()
    try:
        yield server.url
    finally:
        server.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    config = OpenEnvServerConfig(
        request_header_timeout_s=HEADER_TIMEOUT_S, request_body_timeout_s=BODY_TIMEOUT_S
    )
    server = ServerThread(
        create_env_app("blackjack", config)
    ).start()  # ServerThread serves any app with a protocol
    try:
        yield server.url
    finally:
        server.stop()


class Served(NamedTuple):
    url: str
    post_path: bytes  # a route that reads a JSON body


@pytest.fixture(params=[("engine", b"/generate"), ("env", b"/reset")], ids=["engine", "env"])
def served(request: pytest.FixtureRequest) -> Served:
    name, post_path = request.param
    return Served(str(request.getfixturevalue(f"{name}_url")), post_path)


def connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=WAIT_S)


def trickle(sock: socket.socket, pieces: Iterable[bytes], gap_s: float) -> bytes:
    """Sends `pieces`, one each `gap_s`, until the server answers; then what it sent until it closed."""
    answer = b""
    for piece in pieces:
        sock.settimeout(gap_s)
        try:
            answer = sock.recv(4096)
        except TimeoutError:  # nothing yet: trickle on
            sock.sendall(piece)
            continue
        break
    return answer + read_until_closed(sock)


def assert_still_serving(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200


def test_a_connection_that_sends_nothing_or_trickles_its_head_gets_a_408(served: Served) -> None:
    url = served.url
    with connect(url) as idle:
        started = time.monotonic()
        answer = read_until_closed(idle)
        seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"--request-header-timeout-s" in answer and b"connection: close\r\n" in answer, answer
    assert HEADER_TIMEOUT_S * 0.9 <= seconds < HEADER_TIMEOUT_S + 3, seconds
    head = HEALTH[: -len(b"\r\n")] + b"X-Padding: " + b"a" * 50  # ~10 s a byte at a time, and never ends
    with connect(url) as slow:
        started = time.monotonic()
        answer = trickle(slow, (bytes([byte]) for byte in head), gap_s=0.1)
        seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and seconds < HEADER_TIMEOUT_S + 2, answer
    assert_still_serving(url)


def test_a_head_past_its_size_bound_gets_a_431_and_the_server_answers_others_meanwhile(
    served: Served,
) -> None:
    """httptools gathers a header's value by concatenation: a 145 MB one held /health for up to 7 s at a
    time and grew the process by as much. A head within the bound, and a large body sent with its head in
    one write, are served."""
    url = served.url
    with connect(url) as client:
        client.sendall(HEALTH[: -len(b"\r\n")] + b"X-Big: ")
        answer = b""
        for _ in range(64):  # 4 MiB at most, far past the bound; the server cuts it off long before
            client.sendall(b"a" * 16384)
            client.settimeout(0.05)
            try:
                answer = client.recv(65536)
            except TimeoutError:
                assert_still_serving(url)
                continue
            break
        answer += read_until_closed(client)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert f"over {MAX_HEAD_BYTES} bytes".encode() in answer, answer
    near_the_bound = httpx.get(
        f"{url}/health", headers={"X-Big": "a" * (MAX_HEAD_BYTES - 1024)}, timeout=WAIT_S
    )
    assert near_the_bound.status_code == 200, near_the_bound.text
    with connect(url) as client:  # head and 512 KiB of body in one write: the body is no head's
        body = b"x" * 2**19
        client.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        client.settimeout(WAIT_S)
        assert not client.recv(4096).startswith(b"HTTP/1.1 431"), "a body counted as head"
    assert_still_serving(url)


def test_a_body_trickled_in_gets_a_408(served: Served) -> None:
    url = served.url
    request = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with connect(url) as slow:
        slow.sendall(request % served.post_path + b"{")
        started = time.monotonic()
        answer = read_until_closed(slow)
        seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"did not arrive within 1 s" in answer and BODY_TIMEOUT_S * 0.9 <= seconds < BODY_TIMEOUT_S + 3
    assert_still_serving(url)


def chunks(total: int, size: int = 2**16) -> Iterator[bytes]:
    """A streamed body (chunked: no Content-Length) of `total` bytes."""
    for _ in range(total // size):
        yield b" " * size


def test_engine_bodies_are_bounded_whether_announced_or_streamed(engine_url: str) -> None:
    """JSON bodies of any size used to be read and parsed (a 100 MB /generate took 0.9 s and ~600 MB), and
    the update routes checked only an announced Content-Length, so a streamed body of any size was read."""
    with httpx.Client(base_url=engine_url, timeout=WAIT_S) as http:
        json_headers = {"content-type": "application/json"}
        for content in (b" " * (2**20 + 1), chunks(2 * 2**20)):
            refused = http.post("/generate", content=content, headers=json_headers)
            assert refused.status_code == 413 and "limit of 1048576 bytes" in refused.json()["detail"]
        update = http.post(
            "/update_weights_raw", content=chunks(3 * 2**20), headers={"X-Weight-Version": "1"}
        )
        assert update.status_code == 413 and "limit of 2097152 bytes" in update.json()["detail"], update.text
        within = http.post(
            "/generate", json={"prompt_token_ids": [5] * 32, "max_tokens": 1, "stop": ["a" * 1000] * 9}
        )
        assert within.status_code == 200, within.text
        assert http.get("/health").json()["version"] == 0


def test_both_commands_serve_with_the_limits_they_are_given(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protocol reaches uvicorn from the command line (`serve_on`), not only in-thread, and so do the
    body's limits and the connection cap (by default the open-files limit's, which each server raises
    first)."""
    served: list[tuple[float, float, int | None, int]] = []
    raised: list[str] = []  # each server raises its open-files limit (here recorded: this process is left be)

    def record(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app.app  # inside serve_on's startup watch
        [body_limit] = [m.kwargs for m in app.user_middleware if m.cls is BodySizeLimitMiddleware]
        config = getattr(app.state, "service", None)
        max_body = None if config is None else config.config.max_body_bytes
        protocol = self.config.http
        limits = (protocol.header_timeout_s, body_limit["body_timeout_s"], max_body)
        served.append((*limits, protocol.connection_slots.limit))
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", record)
    for module in (inflight.inference.serve_engine, inflight.envs.openenv_server):
        monkeypatch.setattr(
            module, "raise_open_files_limit", lambda name=module.__name__: raised.append(name)
        )
    engine = ["serve-engine", "--model", str(tiny_model_dir), "--port", "0", "--max-body-mib", "0.5"]
    timeouts = ["--request-header-timeout-s", "7", "--request-body-timeout-s", "70"]
    assert main([*engine, *timeouts, "--max-connections", "5"]) == 0
    env = ["env", "serve", "blackjack", "--port", "0"]
    assert main([*env, "--request-header-timeout-s", "8", "--request-body-timeout-s", "80"]) == 0
    assert served == [(7.0, 70.0, 2**19, 5), (8.0, 80.0, None, default_max_connections())]
    assert raised == ["inflight.inference.serve_engine", "inflight.envs.openenv_server"]


@pytest.mark.parametrize("command", [["serve-engine", "--model", "m"], ["env", "serve", "blackjack"]])
def test_max_connections_below_one_is_refused_by_argparse(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in ("0", "-1", "2.5", "many"):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--max-connections", bad])
        assert exited.value.code == 2
        assert "argument --max-connections: expected" in capsys.readouterr().err


@pytest.fixture(params=["engine", "env"])
def capped_url(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[str]:
    """A server of its own that takes MAX_CONNECTIONS connections at once."""
    if request.param == "engine":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # two shared cores
        request.addfinalizer(lambda: torch.set_num_threads(threads))
        engine = BuiltinEngine(
            load_model(tiny_model_dir),
            load_tokenizer(tiny_model_dir),
            BuiltinEngineConfig(max_seq_len_tokens=64),
        )
        config = EngineServerConfig(
            request_header_timeout_s=CAPPED_HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS
        )
        app = create_engine_app(engine, load_tokenizer(tiny_model_dir), config)
    else:
        env_config = OpenEnvServerConfig(
            request_header_timeout_s=CAPPED_HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS
        )
        app = create_env_app("blackjack", env_config)
    server = ServerThread(app).start()
    try:
        yield server.url
    finally:
        server.stop()


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """One answer (status, whole message) on `sock`; every answer here carries its Content-Length."""
    sock.settimeout(WAIT_S)
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < content_length(data):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # a byte sent after a refusal's close: what it wrote was read first
            chunk = b""
        assert chunk, f"the server closed the connection mid-answer: {data!r}"
        data += chunk
    return int(data.split()[1]), data


def content_length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else 0


def assert_refused(url: str) -> None:
    assert_refused_at_once(connect(url), within_s=WAIT_S, head_timeout_s=CAPPED_HEADER_TIMEOUT_S)


def served_once_a_slot_frees(url: str) -> socket.socket:
    """A new connection answered /health with a 200 and kept open. A slot frees once the server has seen its
    connection close, a moment after the client's close: until then a new one gets the 503, for at most
    SLOT_FREED_WITHIN_S."""
    deadline = time.monotonic() + SLOT_FREED_WITHIN_S
    while True:
        sock = connect(url)
        with contextlib.suppress(OSError):  # refused and closed already: its 503 is still there to read
            sock.sendall(HEALTH)
        status, answer = read_answer(sock)
        if status == 200:
            return sock
        sock.close()
        assert status == 503 and time.monotonic() < deadline, answer
        time.sleep(0.05)


def test_a_connection_past_max_connections_gets_a_503_at_once_and_closes_free_their_slots(
    capped_url: str,
) -> None:
    """Held idle connections take every slot; one more is refused unparsed; a slot frees when a connection
    closes, by its client or at the head's deadline, and the count stays exact through it all."""
    url = capped_url
    held = [connect(url) for _ in range(MAX_CONNECTIONS)]
    try:
        assert_refused(url)
        held.pop(0).close()
        with served_once_a_slot_frees(url):
            assert_refused(url)  # the new one holds the freed slot
        for idle in held:  # the two left idle: closed at the head's deadline, which frees their slots too
            assert read_until_closed(idle, within_s=WAIT_S).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    finally:
        for sock in held:
            sock.close()
    fresh = [served_once_a_slot_frees(url) for _ in range(MAX_CONNECTIONS)]
    try:
        assert_refused(url)
    finally:
        for sock in fresh:
            sock.close()


def test_a_ws_session_holds_its_slot_until_it_closes(tiny_model_dir: Path) -> None:
    """uvicorn hands an upgraded connection to its WebSocket protocol: the session keeps its slot, and gives
    it back when it ends."""
    # No head deadline within the test: only the session's end can free a slot.
    config = OpenEnvServerConfig(request_header_timeout_s=60.0, max_connections=MAX_CONNECTIONS)
    server = ServerThread(create_env_app("blackjack", config)).start()
    try:
        ws_url = server.url.replace("http://", "ws://") + "/ws"
        with ws_connect(ws_url, open_timeout=WAIT_S, close_timeout=WAIT_S) as session:
            session.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
            assert json.loads(session.recv(timeout=WAIT_S))["type"] == "observation"
            held = [connect(server.url) for _ in range(MAX_CONNECTIONS - 1)]
            assert_refused(server.url)
        with served_once_a_slot_frees(server.url):
            assert_refused(server.url)
        for sock in held:
            sock.close()
    finally:
        server.stop()


RAISE_IN_A_CHILD = """
import json, resource, sys
from inflight.connections import default_max_connections, raise_open_files_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
lowered_soft, lowered_hard, ceiling = (int(arg) for arg in sys.argv[1:])
resource.setrlimit(resource.RLIMIT_NOFILE, (lowered_soft, hard if lowered_hard < 0 else lowered_hard))
returned = raise_open_files_limit(ceiling)
now = resource.getrlimit(resource.RLIMIT_NOFILE)
default = default_max_connections()
print(json.dumps({"hard": hard, "returned": returned, "now": list(now), "default": default}))
"""


def raised_in_a_child(soft: int, hard: int = -1, ceiling: int = 65_536) -> dict[str, int | list[int]]:
    """What `raise_open_files_limit(ceiling)` does in a child process whose limit is first set to (soft,
    hard; -1: as it was): this process's own limit is never touched."""
    argv = [sys.executable, "-c", RAISE_IN_A_CHILD, str(soft), str(hard), str(ceiling)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, int | list[int]] = json.loads(done.stdout)
    return result


def test_the_open_files_limit_is_raised_to_the_hard_limit_within_a_ceiling_and_never_lowered() -> None:
    first = raised_in_a_child(soft=300)
    hard = first["hard"]
    assert isinstance(hard, int)
    expected = 65_536 if hard == -1 else min(hard, 65_536)  # RLIM_INFINITY is -1 to Python on Linux
    if expected <= 300:
        pytest.skip(f"the hard limit here ({hard}) leaves no room to raise a soft limit of 300")
    assert first["returned"] == expected and first["now"] == [expected, hard], first
    assert first["default"] == min(10_000, expected - 256), first
    # A ceiling under the soft limit lowers nothing; a hard limit as low as the soft one leaves it be.
    within = raised_in_a_child(soft=300, ceiling=200)
    assert within["returned"] == 300 and within["now"] == [300, hard], within
    stuck = raised_in_a_child(soft=300, hard=300)
    assert stuck["returned"] == 300 and stuck["now"] == [300, 300], stuck
    assert stuck["default"] == 150, stuck  # under twice the reserve: half for connections, half for the rest
