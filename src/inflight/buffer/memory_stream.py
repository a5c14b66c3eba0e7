"""`memory://name`: a stream held in this process's memory, shared by every open of the same name.

For single-process runs and tests; nothing survives the process (use file:// or redis:// to resume).
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

from inflight.buffer.streams import NO_OFFSET, Stream, check_consumer, check_read_args
from inflight.errors import UserError


class _Log:
    """The records and offsets of one named stream; every handle of that name points here."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.offsets: dict[str, int] = {}
        self.changed = threading.Condition()


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
            return len(self._log.records) - 1

    def read(self, after: int, max_count: int, timeout_s: float) -> list[tuple[int, bytes]]:
        check_read_args(after, max_count, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._log.changed:
            records = self._log.records
            while len(records) <= after + 1 and (remaining := deadline - time.monotonic()) > 0:
                self._log.changed.wait(remaining)
            first = after + 1
            return [(first + i, r) for i, r in enumerate(records[first : first + max_count])]

    def commit(self, consumer: str, offset: int) -> None:
        check_consumer(consumer)
        with self._log.changed:
            if not NO_OFFSET <= offset < len(self._log.records):
                raise ValueError(
                    f"commit({consumer!r}, {offset}): offset must be in [-1, {len(self._log.records) - 1}]"
                )
            self._log.offsets[consumer] = offset

    def committed(self, consumer: str) -> int:
        check_consumer(consumer)
        with self._log.changed:
            return self._log.offsets.get(consumer, NO_OFFSET)

    def close(self) -> None:
        pass  # the records belong to the name, not to this handle


def drop_memory_stream(name: str) -> None:
    """Forget the records of `memory://name` (tests and long-lived processes that reuse names)."""
    with _LOGS_LOCK:
        _LOGS.pop(name, None)
