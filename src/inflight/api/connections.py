"""The service's HTTP connections: uvicorn's httptools protocol with a deadline on every request's head.

uvicorn bounds no request head: `timeout_keep_alive` runs only between requests and any byte cancels it, so
a client that connects and sends nothing, or trickles a head a byte at a time, holds its connection and a
file descriptor for good, and enough of them lock everyone else out (Slowloris; uvicorn issue #157 asked for
a `--timeout-request-start`, which 0.54 still lacks). Middleware cannot help: it runs once the head is
parsed, which is where the body's deadline lives (`auth.BodySizeLimitMiddleware`). Knows nothing of the app
or its routes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


def header_timeout_protocol(
    timeout_s: float, on_timeout: Callable[[], None] = lambda: None
) -> type[HeaderTimeoutProtocol]:
    """uvicorn's `http=`: HeaderTimeoutProtocol with a deadline of `timeout_s`, calling `on_timeout` (a
    metrics counter) for each connection it closes. uvicorn builds each connection's protocol itself, from
    its config alone (`http_protocol_class(config=..., server_state=..., app_state=..., _loop=...)`), so
    the values travel on a subclass."""

    class BoundHeaderTimeoutProtocol(HeaderTimeoutProtocol):
        header_timeout_s = timeout_s
        timed_out = staticmethod(on_timeout)

    return BoundHeaderTimeoutProtocol


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """A 408 and a closed connection for a request head (request line and headers) not whole
    `header_timeout_s` after it was due: from the connection's start for the first request, and from the
    first byte after an answer for each later one (before that byte, uvicorn's keep-alive timeout bounds
    the idle connection). A request whose head is whole is never cut off here: its body has the body
    timeout, and its answer (a long-poll, a slow route) takes what it takes."""

    header_timeout_s: float  # set by header_timeout_protocol, from ServiceConfig.request_header_timeout_s
    _head_deadline: asyncio.TimerHandle | None = None  # armed while a head is due

    @staticmethod
    def timed_out() -> None:
        """Called once for each connection closed for its head (`header_timeout_protocol`'s `on_timeout`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's own
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is due a head too

    def data_received(self, data: bytes) -> None:
        if not self._answering():
            # What arrives while no request is answered starts the next head, even bytes that begin none:
            # the parser skips blank lines between requests without a callback, and the keep-alive timer
            # that any byte cancels would let "\r\n" every few seconds hold the connection. So does the
            # rest of a body the app answered before reading (a 413).
            self._arm()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a head begun while an earlier request is still answered (pipelining)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _answering(self) -> bool:
        """Whether a request whose head arrived is still being answered (uvicorn's `cycle` is the newest
        one, so this holds while any pipelined one waits too)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _arm(self) -> None:
        # Never re-armed while pending: the deadline runs from when the head was first due, not its last byte.
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_overdue)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self._answering():
            # The late head was pipelined behind a request still being answered: a 408 now would land in
            # that answer, so it waits, one deadline at a time, until the answers owed are sent.
            self._arm()
            return
        self.timed_out()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning(
            "closed the connection from %s with a 408: no whole request head within %g s "
            "(--request-header-timeout-s)",
            client,
            self.header_timeout_s,
        )
        self._send_408()

    def _send_408(self) -> None:
        """A plain-text 408 that ends the connection, written as uvicorn writes its own 400."""
        body = (
            f"no whole request head (request line and headers) arrived within {self.header_timeout_s:g} s "
            "(inflight serve --request-header-timeout-s): send it whole, without pauses\n"
        ).encode()
        content = [b"HTTP/1.1 408 Request Timeout\r\n"]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()
