"""The HTTP connections of inflight's servers (`serve`, `serve-engine`, `env serve`): uvicorn's httptools
protocol with a deadline and a size bound on every request's head, and a deadline on a stalled answer.

uvicorn bounds no request head: `timeout_keep_alive` runs only between requests and any byte cancels it, so
a client that connects and sends nothing, or trickles a head a byte at a time, holds its connection and a
file descriptor for good, and enough of them lock everyone else out (Slowloris; uvicorn issue #157 asked for
a `--timeout-request-start`, which 0.54 still lacks). Nor does it bound a head's size: httptools gathers a
header's value by concatenation, so one endless header both grows the process and stalls its event loop
(145 MB in 20 s held `/health` for up to 7 s). Middleware cannot help: it runs once the head is parsed,
which is where the body's deadline lives (`auth.BodySizeLimitMiddleware`). Nor does it bound how long an
answer may wait for a client that reads nothing of it: the app's send waits, holding the connection, the
response's buffers and any files it streams (an archive download), for good (a slow-read attack). nginx's
`send_timeout` is the model for the answer's deadline. Knows nothing of the apps or their routes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# A request head (request line and headers) larger than this gets a 431. Ample for what inflight's clients,
# the tinker SDK and the openai client send (well under 4 KiB); nginx takes 8 KiB a line, Node 16 KiB a head.
MAX_HEAD_BYTES = 64 * 1024


# Why a connection was closed, for `on_close` (a metrics counter labelled by it).
CloseReason = Literal["head_timeout", "head_too_large", "send_timeout"]
# An answer the client has read nothing of for this long is abandoned: nginx's `send_timeout` default.
SEND_TIMEOUT_S = 60.0


def deadline_protocol(
    head_timeout_s: float,
    *,
    send_timeout_s: float = SEND_TIMEOUT_S,
    on_close: Callable[[CloseReason], None] = lambda reason: None,
) -> type[DeadlineProtocol]:
    """uvicorn's `http=`: DeadlineProtocol with these deadlines, calling `on_close` for each connection it
    closes. uvicorn builds each connection's protocol itself, from its config alone
    (`http_protocol_class(config=..., server_state=..., app_state=..., _loop=...)`), so the values travel
    on a subclass."""

    class BoundDeadlineProtocol(DeadlineProtocol):
        header_timeout_s = head_timeout_s
        answer_timeout_s = send_timeout_s

        @staticmethod
        def closed_for(reason: CloseReason) -> None:
            on_close(reason)

    return BoundDeadlineProtocol


class DeadlineProtocol(HttpToolsProtocol):
    """A 408 and a closed connection for a request head (request line and headers) not whole
    `header_timeout_s` after it was due: from the connection's start for the first request, and from the
    first byte after an answer for each later one (before that byte, uvicorn's keep-alive timeout bounds
    the idle connection). A request whose head is whole is never cut off for its head: its body has the
    body timeout, and its answer (a long-poll, a slow route) takes what it takes. A head still unfinished
    past `MAX_HEAD_BYTES` gets a 431 and a closed connection the same way.

    An answer is abandoned (the connection aborted) once the client has taken none of it for
    `answer_timeout_s` while the transport's buffer is full (from asyncio's `pause_writing` until its
    `resume_writing`). A client that reads, however slowly, is never cut off."""

    header_timeout_s: float  # set by deadline_protocol, from the server's --request-header-timeout-s
    answer_timeout_s: float  # set by deadline_protocol: SEND_TIMEOUT_S, or the server's --send-timeout-s
    _head_deadline: asyncio.TimerHandle | None = None  # armed while a head is due
    _send_deadline: asyncio.TimerHandle | None = None  # armed while the client reads nothing of an answer
    _buffered = 0  # the answer's bytes waiting in the transport when the send deadline was armed
    _head_bytes = 0  # received since the head was due: its own, and at most one read's worth beyond it
    _in_body = False  # the parser is past a head, in its body: what arrives then is no head's

    @staticmethod
    def closed_for(reason: CloseReason) -> None:
        """Called once for each connection closed here (`deadline_protocol`'s `on_close`)."""

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
        if self._head_deadline is not None and not self._in_body:
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked once the parser has the bytes: a head that ended in them was disarmed, however large
        # the read (a body may follow it in the same one).
        if self._head_deadline is None or self._head_bytes <= MAX_HEAD_BYTES:
            return
        if self._answering():
            # Pipelined behind an answer, which a 431 now would land in: nothing more is read till it is sent.
            self.flow.pause_reading()
            return
        self._disarm()
        self.closed_for("head_too_large")
        log.warning(
            "closed the connection from %s with a 431: a request head over %d bytes",
            self._who(),
            MAX_HEAD_BYTES,
        )
        self._send_and_close(
            b"431 Request Header Fields Too Large",
            f"the request head (request line and headers) is over {MAX_HEAD_BYTES} bytes: send a shorter one",
        )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a head begun while an earlier request is still answered (pipelining)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_body = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None:
            self._arm_send_deadline()

    def _arm_send_deadline(self) -> None:
        # resume_writing comes only once the buffer drains below its low-water mark, which a slow reader
        # takes longer than the deadline to reach: what counts is the buffer shrinking at all meanwhile.
        self._buffered = self.transport.get_write_buffer_size()
        self._send_deadline = self.loop.call_later(self.answer_timeout_s, self._send_stalled)

    def resume_writing(self) -> None:
        self._stop_send_deadline()
        super().resume_writing()

    def _stop_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_stalled(self) -> None:
        self._send_deadline = None
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size() < self._buffered:  # the client took some: wait on
            self._arm_send_deadline()
            return
        self.closed_for("send_timeout")
        log.warning(
            "aborted the connection to %s: it read nothing of its answer for %g s (--send-timeout-s)",
            self._who(),
            self.answer_timeout_s,
        )
        # Not close(): that would wait to flush the very buffer the client does not read. uvicorn's
        # connection_lost then marks the request disconnected and wakes the app's waiting send.
        self.transport.abort()

    def _answering(self) -> bool:
        """Whether a request whose head arrived is still being answered (uvicorn's `cycle` is the newest
        one, so this holds while any pipelined one waits too)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _arm(self) -> None:
        # Never re-armed while pending: the deadline runs from when the head was first due, not its last byte.
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_overdue)
            self._head_bytes = 0

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
        self.closed_for("head_timeout")
        log.warning(
            "closed the connection from %s with a 408: no whole request head within %g s "
            "(--request-header-timeout-s)",
            self._who(),
            self.header_timeout_s,
        )
        self._send_and_close(
            b"408 Request Timeout",
            f"no whole request head (request line and headers) arrived within {self.header_timeout_s:g} s "
            "(the server's --request-header-timeout-s): send it whole, without pauses",
        )

    def _who(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _send_and_close(self, status: bytes, message: str) -> None:
        """A plain-text answer that ends the connection, written as uvicorn writes its own 400."""
        body = f"{message}\n".encode()
        content = [b"HTTP/1.1 " + status + b"\r\n"]
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
