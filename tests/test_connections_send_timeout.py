"""The answer's deadline of inflight's HTTP servers (`inflight/connections.py`): a client that reads nothing
of an answer is cut off once `send_timeout_s` passes without progress; one that reads, however slowly, is
not.

Reference: the slow-read attack (the reverse of Slowloris) and nginx's `send_timeout`, whose semantics this
follows (between two successive writes the client takes, not for the whole answer). uvicorn 0.54 has no such
deadline: the app's send waits for the transport to drain, for good. The app here is a minimal streaming
route under the real protocol and uvicorn on a loopback socket; the service's own wiring is checked against
its config.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from inflight.api.app import BackgroundServer, create_app
from inflight.api.service import ServiceConfig
from inflight.connections import CloseReason, deadline_protocol

CHUNK = b"x" * 65536
SEND_TIMEOUT_S = 1.0


class Streamer:
    """A FastAPI app whose /stream answers `chunks` chunks of 64 KiB."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.ended = threading.Event()  # the answer's generator ran to its end, or was stopped
        self.closed: list[CloseReason] = []
        self.app = FastAPI()
        self.app.state.http_protocol = deadline_protocol(
            30.0, send_timeout_s=SEND_TIMEOUT_S, on_close=self.closed.append
        )
        self.app.get("/stream")(self.stream)

    def stream(self) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                for _ in range(self.chunks):
                    yield CHUNK
            finally:
                self.ended.set()

        return StreamingResponse(body(), media_type="application/octet-stream")


def request(server: BackgroundServer) -> socket.socket:
    """A connection that asked for /stream, with a small receive window so the server's buffers fill."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.settimeout(30)
    client.connect(("127.0.0.1", server.port))
    client.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
    return client


def read_all(client: socket.socket, pause_s: float = 0.0) -> int:
    """Bytes read until the server ends the connection (EOF or reset), `pause_s` between reads."""
    total = 0
    while True:
        try:
            data = client.recv(65536)
        except ConnectionResetError:
            return total
        if not data:
            return total
        total += len(data)
        time.sleep(pause_s)


def test_an_answer_nobody_reads_is_abandoned_after_the_send_timeout() -> None:
    streamer = Streamer(chunks=1024)  # 64 MiB: far past every buffer between the app and the client
    with BackgroundServer(streamer.app) as server, request(server) as client:
        start = time.monotonic()
        assert streamer.ended.wait(SEND_TIMEOUT_S + 20), (
            "the app's send waited on a client that reads nothing"
        )
        elapsed = time.monotonic() - start
        assert streamer.closed == ["send_timeout"]
        assert SEND_TIMEOUT_S <= elapsed < SEND_TIMEOUT_S + 20
        # What was buffered, then the end: the rest went nowhere (uvicorn drops what a disconnected
        # request sends, so the app's generator may still run to its end, at once).
        assert read_all(client) < streamer.chunks * len(CHUNK)


def test_a_client_that_reads_slowly_gets_the_whole_answer() -> None:
    # 192 KiB at ~60 KiB/s, with the server's socket buffer small (accepted sockets inherit the listening
    # socket's), so the app's writes stall for ~2 s at a time: longer than the deadline before the buffer
    # drains below its low-water mark, yet the client takes some with every read.
    streamer = Streamer(chunks=3)
    server = BackgroundServer(streamer.app)
    server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with server, request(server) as client:
        head_and_body = b""
        while b"\r\n\r\n" not in head_and_body:
            head_and_body += client.recv(4096)
        assert head_and_body.startswith(b"HTTP/1.1 200 OK")
        client.settimeout(5)
        data = read_all_until(client, len(head_and_body), pause_s=0.1)
        assert streamer.closed == []
        assert data >= streamer.chunks * len(CHUNK)


def read_all_until(client: socket.socket, already: int, pause_s: float) -> int:
    """Bytes read (counting `already`) until the chunked answer's last chunk, `pause_s` between reads."""
    total, tail = already, b""
    while not tail.endswith(b"0\r\n\r\n"):
        data = client.recv(65536)
        assert data, "the server ended the connection before the answer"
        total += len(data)
        tail = (tail + data)[-16:]
        time.sleep(pause_s)
    return total


def test_the_service_gives_its_protocol_the_configured_send_timeout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = ServiceConfig(base_models={"tiny": str(tiny_model_dir)}, state_dir=tmp_path, send_timeout_s=7.5)
    protocol = create_app(config).state.http_protocol
    assert protocol.answer_timeout_s == 7.5 and protocol.header_timeout_s == config.request_header_timeout_s
