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
`send_timeout` is the model for the answer's deadline.

Nor does uvicorn bound how many connections are open: only the process's file descriptors did (the soft
RLIMIT_NOFILE, often 1,024), so a client opening connections faster than the head's deadline closes them
took every descriptor, and then uvicorn's accept failed in a loop and the service's database, checkpoints
and engine files could not be opened, failing every tenant. So each server raises its soft limit at start
(`raise_open_files_limit`) and answers a connection past its cap (`--max-connections`) at once with a 503,
a Retry-After and a close, unparsed; uvicorn's `limit_concurrency` would not do: it counts tasks too and
parses the request first. Knows nothing of the apps or their routes.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from typing import Literal, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr

log = logging.getLogger(__name__)

# A request head (request line and headers) larger than this gets a 431. Ample for what inflight's clients,
# the tinker SDK and the openai client send (well under 4 KiB); nginx takes 8 KiB a line, Node 16 KiB a head.
MAX_HEAD_BYTES = 64 * 1024


# Why a connection was closed, for `on_close` (a metrics counter labelled by it).
CloseReason = Literal["head_timeout", "head_too_large", "send_timeout", "too_many_connections"]
# An answer the client has read nothing of for this long is abandoned: nginx's `send_timeout` default.
SEND_TIMEOUT_S = 60.0

# How far `raise_open_files_limit` takes the soft RLIMIT_NOFILE (when the hard limit allows): room for the
# largest default cap and its reserve many times over, while programs that walk every possible descriptor
# (a child closing them all before an exec, select()-based code) stay fast.
OPEN_FILES_CEILING = 65_536
# Descriptors the default cap leaves for what a server opens besides its connections: the SQLite database
# and its WAL, checkpoint and model files, engine processes' pipes, its own clients' sockets (Ray, vLLM).
RESERVED_FDS = 256
# The default cap, however many descriptors there are: far above what inflight's clients open (a trainer's
# SDK or engine client pools some dozens of connections), while what they may buffer at once (a head of up
# to 64 KiB each) stays under 1 GiB and one event loop thread serves them all.
MAX_CONNECTIONS_CEILING = 10_000
# A refused client's wait before it tries again (the tinker and openai SDKs honour Retry-After up to 60 s):
# connections come and go by the second, and a flood's own idle ones end within the head's deadline.
RETRY_AFTER_S = 5
# A refusal is logged at most this often, with the count since: a flood would otherwise write a line each.
REFUSAL_LOG_EVERY_S = 10.0


def raise_open_files_limit(ceiling: int = OPEN_FILES_CEILING) -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit, at most `ceiling`, and returns the soft
    limit then. Never lowers it; one that cannot be raised (a hard limit the OS will not grant) stays as it
    is. Any process may do this for itself, so the processes it starts (engines, sandboxed programs)
    gain no descriptor they could not take anyway."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    # macOS refuses more than kern.maxfilesperproc, whatever the hard limit
    except (ValueError, OSError) as e:
        log.warning(
            "could not raise the open-files limit from %d to %d (%s): it stays %d", soft, target, e, soft
        )
        return soft
    return target


def default_max_connections() -> int:
    """`--max-connections`' default: the soft RLIMIT_NOFILE less `RESERVED_FDS` (half of it, for a limit
    under twice the reserve), at most `MAX_CONNECTIONS_CEILING`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(1, min(MAX_CONNECTIONS_CEILING, max(soft - RESERVED_FDS, soft // 2)))


class ConnectionSlots:
    """One server's open connections against its cap: taken as each is accepted, given back as it closes.
    Touched only from the server's event loop thread."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a server needs at least one connection, got a cap of {limit}")
        self.limit = limit
        self.open = 0
        self.refused = 0  # since the server started
        self._refused_unlogged = 0
        self._next_log = 0.0  # monotonic time before which a refusal is not logged

    def take(self) -> bool:
        if self.open >= self.limit:
            self.refused += 1
            self._refused_unlogged += 1
            return False
        self.open += 1
        return True

    def give_back(self) -> None:
        self.open -= 1

    def refusals_to_log(self) -> int:
        """The refusals not yet logged, when it is time to log them (then counted as logged); else 0."""
        now = time.monotonic()
        if now < self._next_log:
            return 0
        self._next_log = now + REFUSAL_LOG_EVERY_S
        count, self._refused_unlogged = self._refused_unlogged, 0
        return count


def deadline_protocol(
    head_timeout_s: float,
    *,
    send_timeout_s: float = SEND_TIMEOUT_S,
    max_connections: int | None = None,
    on_close: Callable[[CloseReason], None] = lambda reason: None,
) -> type[DeadlineProtocol]:
    """uvicorn's `http=`: DeadlineProtocol with these deadlines and at most `max_connections` open at once
    (None: `default_max_connections()`, read now), calling `on_close` for each connection it closes. uvicorn
    builds each connection's protocol itself, from its config alone (`http_protocol_class(config=...,
    server_state=..., app_state=..., _loop=...)`), so the values, and the one count all of a server's
    connections share, travel on a subclass: one per server."""
    slots = ConnectionSlots(default_max_connections() if max_connections is None else max_connections)

    class BoundDeadlineProtocol(DeadlineProtocol):
        header_timeout_s = head_timeout_s
        answer_timeout_s = send_timeout_s
        connection_slots = slots

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
    `resume_writing`). A client that reads, however slowly, is never cut off.

    A connection accepted while `connection_slots` are all taken gets a 503 with a Retry-After and is
    closed at once, before a byte of it is read; uvicorn never sees it. The others hold a slot until they
    close, for whatever reason, a WebSocket one (handed to uvicorn's WebSocket protocol) included."""

    header_timeout_s: float  # set by deadline_protocol, from the server's --request-header-timeout-s
    answer_timeout_s: float  # set by deadline_protocol: SEND_TIMEOUT_S, or the server's --send-timeout-s
    connection_slots: ConnectionSlots  # set by deadline_protocol: the server's, from its --max-connections
    _holds_slot = False  # taken in connection_made; given back once, when the connection is lost
    _head_deadline: asyncio.TimerHandle | None = None  # armed while a head is due
    _send_deadline: asyncio.TimerHandle | None = None  # armed while the client reads nothing of an answer
    _buffered = 0  # the answer's bytes waiting in the transport when the send deadline was armed
    _head_bytes = 0  # received since the head was due: its own, and at most one read's worth beyond it
    _in_body = False  # the parser is past a head, in its body: what arrives then is no head's

    @staticmethod
    def closed_for(reason: CloseReason) -> None:
        """Called once for each connection closed here (`deadline_protocol`'s `on_close`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's own
        if not self.connection_slots.take():
            self._refuse(transport)
            return
        self._holds_slot = True
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing is due a head too

    def _refuse(self, transport: asyncio.Transport) -> None:
        # Before uvicorn's connection_made, so nothing of uvicorn's is set up (not even its flow control):
        # the answer is small enough for the socket to take at once, and nothing is read.
        self.transport = transport
        self.client = get_remote_addr(transport)
        slots = self.connection_slots
        self.closed_for("too_many_connections")
        refused = slots.refusals_to_log()
        if refused:
            log.warning(
                "refused %d connection(s) with a 503, the latest from %s: %d open, --max-connections %d "
                "(%d refused since the server started)",
                refused,
                self._who(),
                slots.open,
                slots.limit,
                slots.refused,
            )
        self._send_and_close(
            b"503 Service Unavailable",
            f"the server has its most connections open ({slots.limit}, its --max-connections): "
            f"try again in {RETRY_AFTER_S} s",
            extra_headers=[(b"retry-after", b"%d" % RETRY_AFTER_S)],
        )

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
        if not self._holds_slot:  # refused: uvicorn never had it
            return
        self._holds_slot = False
        self.connection_slots.give_back()
        self._disarm()
        self._stop_send_deadline()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        # uvicorn hands the connection to a WebSocket protocol, and asyncio calls that one's connection_lost,
        # never this one's: the slot goes with it, and no deadline of this protocol may fire into it.
        super().handle_websocket_upgrade()
        self._disarm()
        self._stop_send_deadline()
        if self._holds_slot:
            self._holds_slot = False
            websocket = cast(asyncio.Protocol, self.transport.get_protocol())  # uvicorn's are Protocols
            self.transport.set_protocol(_GivesBackItsSlot(websocket, self.connection_slots))

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

    def _send_and_close(
        self, status: bytes, message: str, extra_headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """A plain-text answer that ends the connection, written as uvicorn writes its own 400."""
        body = f"{message}\n".encode()
        content = [b"HTTP/1.1 " + status + b"\r\n"]
        for name, value in [*self.server_state.default_headers, *(extra_headers or [])]:
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


class _GivesBackItsSlot(asyncio.Protocol):
    """A WebSocket connection's protocol as asyncio sees it: uvicorn's, whose slot is given back when the
    connection is lost."""

    def __init__(self, inner: asyncio.Protocol, slots: ConnectionSlots) -> None:
        self.inner = inner
        self.slots = slots

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.slots.give_back()
        self.inner.connection_lost(exc)
