"""`memory://name`: a stream held in this process's memory, shared by every open of the same name.

For single-process runs and tests; nothing survives the process (use file:// or redis:// to resume).
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

from inflight.buffer.streams import NO_OFFSET, Stream, TrimmedError, check_consumer, check_read_args
from inflight.errors import UserError


class _Log:
    """The records and offsets of one named stream; every handle of that name points here."""

    def __init__(self) -> None:
        self.first = 0  # the offset of records[0]: trim() drops a prefix, the offsets stay
        self.records: list[bytes] = []
        self.offsets: dict[str, int] = {}
        self.changed = threading.Condition()

    @property
    def end(self) -> int:
        """The offset the next append gets."""
        return self.first + len(self.records)


_LOGS: dict[str, _Log] = {}
_LOGS_LOCK = threading.Lock()


class MemoryStream(Stream):
    def __init__(self, name: str) -> None:
        if not name:
            raise UserError("memory stream needs a name: memory://NAME")
        self.url = f"memory://{name}"
        with _LOGS_LOCK:
            self._log = _LOGS.setdefault(name, _Log())

    @classmethod
    def from_url(cls, url: str) -> MemoryStream:
        parts = urlsplit(url)
        if parts.path not in ("", "/") or parts.query:
            raise UserError(f"stream url {url!r}: a memory stream is memory://NAME, with no path or options")
        return cls(parts.netloc)

    def append(self, record: bytes) -> int:
        record = bytes(record)  # a caller's bytearray must not change the stored record later
        with self._log.changed:
            self._log.records.append(record)
            self._log.changed.notify_all()
            return self._log.end - 1

    def read(self, after: int, max_count: int, timeout_s: float) -> list[tuple[int, bytes]]:
        check_read_args(after, max_count, timeout_s)
        deadline = time.monotonic() + timeout_s
        log, first = self._log, after + 1
        with log.changed:
            while True:
                if first < log.first:  # checked after every wait too: another handle may have trimmed
                    raise TrimmedError(self.url, first, log.first)
                remaining = deadline - time.monotonic()
                if log.end > first or remaining <= 0:
                    break
                log.changed.wait(remaining)
            start = first - log.first
            return [(first + i, r) for i, r in enumerate(log.records[start : start + max_count])]

    def commit(self, consumer: str, offset: int) -> None:
        check_consumer(consumer)
        with self._log.changed:
            end = self._log.end
            if not NO_OFFSET <= offset < end:
                raise ValueError(f"commit({consumer!r}, {offset}): offset must be in [-1, {end - 1}]")
            self._log.offsets[consumer] = offset

    def committed(self, consumer: str) -> int:
        check_consumer(consumer)
        with self._log.changed:
            return self._log.offsets.get(consumer, NO_OFFSET)

    def trim(self, before: int) -> None:
        log = self._log
        with log.changed:
            drop = min(max(before - log.first, 0), len(log.records))
            del log.records[:drop]
            log.first += drop

    def close(self) -> None:
        pass  # the records belong to the name, not to this handle


def drop_memory_stream(name: str) -> None:
    """Forget the records of `memory://name` (tests and long-lived processes that reuse names)."""
    with _LOGS_LOCK:
        _LOGS.pop(name, None)
