"""A request's head has a deadline (`--request-header-timeout-s`, connections.py), and only its head.

Reference: Slowloris, and uvicorn issue #157 (its "--timeout-request-start" never built): uvicorn bounds no
head, so a client that connected and sent nothing, or trickled its headers a byte at a time, held its
connection and a file descriptor for good. Now it gets a 408 naming the option and is closed; a head that
arrives in time is never cut off, however long its body (within the body timeout) or its answer (a
long-poll) takes, and a kept-alive connection serves request after request. Connections open at once are
capped too (`--max-connections`): they were bounded only by the file descriptors, which a flood took from the
database and checkpoints; one past the cap gets a 503 at once, counted in /metrics. Real sockets against the
real app and protocol on loopback; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import re
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import inflight.api.app
from conftest import assert_refused_at_once, read_until_closed, sdk_server
from inflight.api.access_log import REQUEST_LOGGER
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig
from inflight.cli import main
from inflight.connections import default_max_connections

pytestmark = pytest.mark.slow

BASE = "tiny-base"
HEADER_TIMEOUT_S = 1.0
LONG_POLL_HOLD_S = 2.5  # a slow answer: longer than the head's deadline
KEEP_ALIVE_S = 5  # uvicorn's default timeout_keep_alive, which BackgroundServer keeps
WAIT_S = 10.0  # the most any one read waits: a test that would hang fails instead
HEALTHZ = b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n"
MAX_CONNECTIONS = 3
# The capped server's head deadline: past the steps a test takes before it, short enough to wait out.
CAPPED_HEADER_TIMEOUT_S = 5.0
# How long a slot may take to free after its connection closed (the server sees the close a moment after
# the client makes it): well within the head's deadline, so that no slot freed by that deadline counts.
SLOT_FREED_WITHIN_S = CAPPED_HEADER_TIMEOUT_S / 2


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=tmp_path_factory.mktemp("serve"),
        request_header_timeout_s=HEADER_TIMEOUT_S,
        request_body_timeout_s=10.0,
        long_poll_hold_s=LONG_POLL_HOLD_S,
    )
    with sdk_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def connect(server: BackgroundServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response (status, body) on a kept-alive connection; the app's responses carry Content-Length."""
    sock.settimeout(WAIT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection mid-answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length.group(1)):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection mid-body: {data!r}"
        body += chunk
    return int(head.split()[1]), body


def post_request(route: str, body: bytes, content_length: int | None = None) -> bytes:
    """A POST with `body`, announcing `content_length` bytes (by default the body's)."""
    length = len(body) if content_length is None else content_length
    return (
        f"POST /api/v1/{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode() + body


def header_timeouts(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    found = re.search(r'(?m)^inflight_http_connections_closed_total\{reason="head_timeout"\} (\S+)$', metrics)
    assert found is not None, metrics
    return float(found.group(1))


def assert_timed_out(answer: bytes) -> None:
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"connection: close\r\n" in answer, answer
    assert f"within {HEADER_TIMEOUT_S:g} s".encode() in answer and b"--request-header-timeout-s" in answer


def test_a_connection_that_sends_nothing_gets_a_408_and_is_closed(
    server: BackgroundServer, http: httpx.Client
) -> None:
    before = header_timeouts(http)
    with connect(server) as idle:
        started = time.monotonic()
        answer = read_until_closed(idle)
        seconds = time.monotonic() - started
    assert_timed_out(answer)
    assert HEADER_TIMEOUT_S * 0.9 <= seconds < HEADER_TIMEOUT_S + 3, seconds
    assert header_timeouts(http) == before + 1


def trickle(sock: socket.socket, pieces: Iterable[bytes], gap_s: float) -> tuple[bytes, float]:
    """Sends `pieces`, one each `gap_s` (far within keep-alive), until the server answers, then reads until
    it closes: what it sent, and the seconds that took. Bounded: the pieces run out."""
    started = time.monotonic()
    answer = b""
    for piece in pieces:
        sock.settimeout(gap_s)
        try:
            answer = sock.recv(4096)
        except TimeoutError:  # nothing yet: trickle on
            sock.sendall(piece)
            continue
        break
    answer += read_until_closed(sock)
    return answer, time.monotonic() - started


def test_a_head_trickled_in_is_cut_off_at_the_deadline(server: BackgroundServer, http: httpx.Client) -> None:
    """A byte every 0.1 s: the head would take ~10 s, and never ends."""
    head = HEALTHZ[: -len(b"\r\n")] + b"X-Padding: " + b"a" * 50
    with connect(server) as slow:
        answer, seconds = trickle(slow, (bytes([byte]) for byte in head), gap_s=0.1)
    assert_timed_out(answer)
    assert seconds < HEADER_TIMEOUT_S + 2, seconds
    assert http.get("/api/v1/healthz").status_code == 200


def test_blank_lines_after_an_answer_do_not_hold_the_connection(server: BackgroundServer) -> None:
    """The parser skips blank lines between requests without starting one, and any byte cancels uvicorn's
    keep-alive timer: a "\\r\\n" every 0.2 s used to hold a kept-alive connection for good."""
    with connect(server) as client:
        client.sendall(HEALTHZ)
        assert read_response(client)[0] == 200
        answer, seconds = trickle(client, itertools.repeat(b"\r\n", 25), gap_s=0.2)
    assert_timed_out(answer)
    assert seconds < HEADER_TIMEOUT_S + 2, seconds


def test_the_rest_of_a_refused_body_does_not_hold_the_connection(server: BackgroundServer) -> None:
    """A body over the limit is refused (413) on its Content-Length, before it is read; what the client
    sends of it after that answer belongs to no request, and held the connection as blank lines did."""
    with connect(server) as client:
        client.sendall(post_request("create_session", b"{", content_length=2**30))
        assert read_response(client)[0] == 413
        answer, seconds = trickle(client, itertools.repeat(b" ", 25), gap_s=0.2)
    assert_timed_out(answer)
    assert seconds < HEADER_TIMEOUT_S + 2, seconds


def test_a_kept_alive_connection_serves_request_after_request(server: BackgroundServer) -> None:
    """The deadline runs per head: idling between answers (up to keep-alive) and a head sent in two parts
    within its deadline are served, request after request, on one connection."""
    with connect(server) as client:
        time.sleep(HEADER_TIMEOUT_S / 2)  # the first head late, within its deadline
        client.sendall(HEALTHZ)
        assert read_response(client)[0] == 200
        for _ in range(2):
            time.sleep(HEADER_TIMEOUT_S * 1.5)  # idle past the head's deadline, within keep-alive
            assert HEADER_TIMEOUT_S * 1.5 < KEEP_ALIVE_S
            client.sendall(HEALTHZ[:20])
            time.sleep(HEADER_TIMEOUT_S / 2)
            client.sendall(HEALTHZ[20:])
            assert read_response(client)[0] == 200


def settled(http: httpx.Client, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer: dict[str, Any] = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if answer.get("type") != "try_again":
            return answer
    pytest.fail(f"future {request_id} still unfinished after 60 s")


def new_model(http: httpx.Client) -> str:
    session_id = http.post("/api/v1/create_session", json={}).json()["session_id"]
    created = http.post(
        "/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": BASE}
    ).json()
    assert "error" not in settled(http, created["request_id"])
    return str(created["model_id"])


def optim_step(http: httpx.Client, model_id: str, seq_id: int) -> str:
    """The request id of an optimizer step, which waits while an earlier seq_id is missing (so does a
    long-poll on it, for `long_poll_hold_s`)."""
    body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}
    accepted = http.post("/api/v1/optim_step", json=body)
    assert accepted.status_code == 200, accepted.text
    return str(accepted.json()["request_id"])


def retrieve(request_id: str) -> bytes:
    return post_request("retrieve_future", json.dumps({"request_id": request_id}).encode())


def test_a_long_poll_answered_after_the_deadline_is_not_cut_off(
    server: BackgroundServer, http: httpx.Client
) -> None:
    model_id = new_model(http)
    behind_a_gap = optim_step(http, model_id, 2)
    with connect(server) as client:
        started = time.monotonic()
        client.sendall(retrieve(behind_a_gap))
        status, answer = read_response(client)
        assert time.monotonic() - started >= LONG_POLL_HOLD_S
        assert status == 200 and json.loads(answer)["type"] == "try_again", answer
        optim_step(http, model_id, 1)
        client.sendall(retrieve(behind_a_gap))  # the same connection, after the slow answer
        status, answer = read_response(client)
        assert status == 200 and "error" not in json.loads(answer), answer


def test_a_late_head_pipelined_behind_a_slow_answer_gets_its_408_after_that_answer(
    server: BackgroundServer, http: httpx.Client
) -> None:
    """A 408 when the pipelined head is due would land inside the long-poll's answer: it waits for it."""
    model_id = new_model(http)
    behind_a_gap = optim_step(http, model_id, 2)
    with connect(server) as client:
        started = time.monotonic()
        client.sendall(retrieve(behind_a_gap) + HEALTHZ[:20])
        answers = read_until_closed(client)
        seconds = time.monotonic() - started
    optim_step(http, model_id, 1)  # the gap filled: nothing is left waiting at shutdown
    first, _, late = answers.partition(b"HTTP/1.1 408")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b'"try_again"' in first, answers
    assert_timed_out(b"HTTP/1.1 408" + late)
    assert LONG_POLL_HOLD_S <= seconds < LONG_POLL_HOLD_S + HEADER_TIMEOUT_S + 2, seconds


def test_a_body_sent_slowly_within_its_own_deadline_is_not_cut_off(server: BackgroundServer) -> None:
    body = json.dumps({"tags": ["slow-body"], "user_metadata": {"note": "sent in three parts"}}).encode()
    request = post_request("create_session", body)
    head_end = len(request) - len(body)
    with connect(server) as client:
        client.sendall(request[:head_end])
        for start in range(0, len(body), len(body) // 3 + 1):  # ~2.4 s in all, past the head's deadline
            time.sleep(HEADER_TIMEOUT_S * 0.8)
            client.sendall(body[start : start + len(body) // 3 + 1])
        status, answer = read_response(client)
    assert status == 200 and json.loads(answer)["session_id"], answer


@pytest.fixture
def capped_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=tmp_path,
        request_header_timeout_s=CAPPED_HEADER_TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
    )
    with sdk_server(config) as running:
        yield running


def assert_refused(server: BackgroundServer) -> None:
    assert_refused_at_once(connect(server), within_s=WAIT_S, head_timeout_s=CAPPED_HEADER_TIMEOUT_S)


def served_once_a_slot_frees(server: BackgroundServer) -> tuple[socket.socket, int]:
    """A new connection answered /api/v1/healthz with a 200 and kept open, and the 503s before it: a slot
    frees once the server has seen its connection close, a moment after the client's close: until then
    a new one gets the 503, for at most SLOT_FREED_WITHIN_S."""
    deadline = time.monotonic() + SLOT_FREED_WITHIN_S
    refusals = 0
    while True:
        sock = connect(server)
        with contextlib.suppress(OSError):  # refused and closed already: its 503 is still there to read
            sock.sendall(HEALTHZ)
        try:
            status, answer = read_response(sock)
        except ConnectionResetError:  # the request reached a refused connection's closed socket
            status, answer = 503, b"reset after a refusal"
        if status == 200:
            return sock, refusals
        sock.close()
        refusals += 1
        assert status == 503 and time.monotonic() < deadline, answer
        time.sleep(0.05)


def refused_connections(sock: socket.socket) -> float:
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    status, metrics = read_response(sock)
    assert status == 200, metrics
    pattern = rb'(?m)^inflight_http_connections_closed_total\{reason="too_many_connections"\} (\S+)$'
    found = re.search(pattern, metrics)
    assert found is not None, metrics
    return float(found.group(1))


def test_a_connection_past_max_connections_gets_a_503_at_once_and_closes_free_their_slots(
    capped_server: BackgroundServer,
) -> None:
    """Held idle connections take every slot; one more is refused unparsed and counted; a slot frees when a
    connection closes, by its client or at the head's deadline, and the count stays exact through it all."""
    held = [connect(capped_server) for _ in range(MAX_CONNECTIONS)]
    try:
        assert_refused(capped_server)
        held.pop(0).close()
        served, refusals = served_once_a_slot_frees(capped_server)
        with served:
            assert refused_connections(served) == 1 + refusals
            assert_refused(capped_server)  # the new one holds the freed slot
        for idle in held:  # the two left idle: closed at the head's deadline, which frees their slots too
            assert_timed_out_after(read_until_closed(idle, within_s=WAIT_S), CAPPED_HEADER_TIMEOUT_S)
    finally:
        for sock in held:
            sock.close()
    fresh = [served_once_a_slot_frees(capped_server)[0] for _ in range(MAX_CONNECTIONS)]
    try:
        assert_refused(capped_server)
    finally:
        for sock in fresh:
            sock.close()


def assert_timed_out_after(answer: bytes, header_timeout_s: float) -> None:
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert f"within {header_timeout_s:g} s".encode() in answer, answer


def test_serve_takes_max_connections_and_raises_the_open_files_limit(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inflight serve --max-connections N` reaches the protocol uvicorn is given (default: derived from
    the open-files limit, which serve raises first; recorded here, so this process's is left be), and a
    cap below 1 is refused by argparse."""
    caps: list[int] = []
    raised: list[bool] = []

    def record(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        caps.append(self.config.http.connection_slots.limit)
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", record)
    monkeypatch.setattr(inflight.api.app, "raise_open_files_limit", lambda: raised.append(True))
    argv = ["serve", "--base-model", f"{BASE}={tiny_model_dir}", "--port", "0"]
    assert main([*argv, "--state-dir", str(tmp_path / "a"), "--max-connections", "7"]) == 0
    assert main([*argv, "--state-dir", str(tmp_path / "b")]) == 0
    assert caps == [7, default_max_connections()] and raised == [True, True]
    # The request log's stdout handler went with each service (the other tests' servers log elsewhere).
    assert not logging.getLogger(REQUEST_LOGGER).handlers
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--max-connections", "0"])
    assert exited.value.code == 2
