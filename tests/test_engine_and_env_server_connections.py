"""`inflight serve-engine` and `inflight env serve` bound every request's head and body, in time and in size,
as `inflight serve` does (`inflight.connections`, `auth.py`'s BodySizeLimitMiddleware).

Reference: the hostile-input pass over both servers (a connection that sent nothing, or trickled its head or
its body, was held for good; a 145 MB header was taken in, stalling the event loop for seconds at a time;
the engine read and parsed JSON bodies of any size, and a chunked update body of any size), and
`tests/test_api_header_timeout.py`, which holds the same head deadline for `inflight serve`. Real sockets
against the real apps and protocol in-thread on loopback; every wait is bounded.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import torch
import uvicorn

from conftest import read_until_closed
from inflight.auth import BodySizeLimitMiddleware
from inflight.cli import main
from inflight.connections import MAX_HEAD_BYTES
from inflight.envs.openenv_server import OpenEnvServerConfig
from inflight.envs.openenv_server import create_app as create_env_app
from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.server import EngineServerConfig, ServerThread
from inflight.inference.server import create_app as create_engine_app
from inflight.models import load_model, load_tokenizer

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
WAIT_S = 10.0  # the most any one read waits: a test that would hang fails instead
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


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
    body's limits."""
    served: list[tuple[float, float, int | None]] = []

    def record(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app.app  # inside serve_on's startup watch
        [body_limit] = [m.kwargs for m in app.user_middleware if m.cls is BodySizeLimitMiddleware]
        config = getattr(app.state, "service", None)
        max_body = None if config is None else config.config.max_body_bytes
        served.append((self.config.http.header_timeout_s, body_limit["body_timeout_s"], max_body))
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", record)
    engine = ["serve-engine", "--model", str(tiny_model_dir), "--port", "0", "--max-body-mib", "0.5"]
    assert main([*engine, "--request-header-timeout-s", "7", "--request-body-timeout-s", "70"]) == 0
    env = ["env", "serve", "blackjack", "--port", "0"]
    assert main([*env, "--request-header-timeout-s", "8", "--request-body-timeout-s", "80"]) == 0
    assert served == [(7.0, 70.0, 2**19), (8.0, 80.0, None)]
