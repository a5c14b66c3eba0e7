"""`file:///dir`: an append-only log of checksummed records plus consumer offsets, all in one directory.

Layout: `records.log` holds records as [u32 payload length][u32 crc32(length bytes + payload)][payload];
`consumers/NAME.offset` holds one consumer's committed offset, replaced atomically; `writer.lock` is an
flock that serialises appends across processes. It knows nothing of what the records mean.

Crash contract: an append that returned survives a SIGKILL of any process (the bytes are in the page
cache); a power loss keeps what was fsynced (see `fsync`). A writer killed mid-append leaves a torn last
record; the next open or append, holding the lock, truncates it away. Readers never return a record whose
checksum fails, and treat an incomplete tail as "not written yet" (another process may be mid-write).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from inflight.buffer.streams import NO_OFFSET, Stream, check_consumer, check_read_args, query_options
from inflight.errors import UserError

LOG_NAME = "records.log"
LOCK_NAME = "writer.lock"
CONSUMERS_DIR = "consumers"
_HEADER = struct.Struct("<II")  # payload length, crc32 over (length bytes + payload)
_SCAN_CHUNK_BYTES = 4 << 20


class FileStreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # always: fsync every append (survives power loss, slowest); interval: at most every fsync_interval_s
    # and on commit/close; never: leave it to the OS (still survives any process crash).
    fsync: Literal["always", "interval", "never"] = "interval"
    fsync_interval_s: float = 1.0
    # Cross-process readers notice other processes' appends by polling the file size this often.
    poll_interval_s: float = 0.02
    max_record_bytes: int = (1 << 32) - 1  # the u32 length field's limit

    @model_validator(mode="after")
    def _check(self) -> FileStreamConfig:
        if self.fsync_interval_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("fsync_interval_s must be >= 0 and poll_interval_s > 0")
        if not 0 < self.max_record_bytes < 1 << 32:
            raise ValueError("max_record_bytes must be in [1, 2**32 - 1] (the record length is a u32)")
        return self


class CorruptLogError(RuntimeError):
    """A record in the middle of the log fails its checksum: not a torn write, so nothing is truncated."""


def _record_crc(length_bytes: bytes, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(length_bytes))


class FileStream(Stream):
    def __init__(self, directory: str | Path, config: FileStreamConfig | None = None) -> None:
        self.config = config or FileStreamConfig()
        self.directory = Path(directory)
        self.url = f"file://{self.directory.resolve()}"
        (self.directory / CONSUMERS_DIR).mkdir(parents=True, exist_ok=True)
        self._log_path = self.directory / LOG_NAME
        # O_APPEND: every write lands at the current end even if another process grew the file.
        self._fd = os.open(self._log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        self._starts = array("q")  # byte position of each indexed record; offset = index
        self._end = 0  # byte position just after the last indexed record
        self._lock = threading.Lock()  # guards the index and the fds within this process
        self._appended = threading.Condition(self._lock)
        self._last_fsync = time.monotonic()
        self._closed = False
        with self._lock, self._writer_lock():
            self._scan(truncate_torn_tail=True)

    @classmethod
    def from_url(cls, url: str) -> FileStream:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise UserError(f"stream url {url!r}: use an absolute path, file:///abs/dir (three slashes)")
        options = query_options(parts.query, set(FileStreamConfig.model_fields), url)
        try:
            config = FileStreamConfig.model_validate(options)
        except ValidationError as e:
            raise UserError(f"stream url {url!r}: {e}") from e
        return cls(parts.path, config)

    # -- writing ---------------------------------------------------------------------------------

    def append(self, record: bytes) -> int:
        if len(record) > self.config.max_record_bytes:
            raise ValueError(
                f"record of {len(record)} bytes exceeds max_record_bytes={self.config.max_record_bytes}"
            )
        length_bytes = struct.pack("<I", len(record))
        data = _HEADER.pack(len(record), _record_crc(length_bytes, record)) + bytes(record)
        with self._appended, self._writer_lock():
            self._check_open()
            # Under the lock no other writer is mid-append, so an invalid tail is torn: cut it off first.
            self._scan(truncate_torn_tail=True)
            start = self._end
            try:
                view = memoryview(data)
                while view:  # os.write may write less than asked (signals, huge buffers)
                    view = view[os.write(self._fd, view) :]
            except BaseException:
                os.ftruncate(self._fd, start)  # never leave our own half record behind
                raise
            self._starts.append(start)
            self._end = start + len(data)
            self._maybe_fsync(force=self.config.fsync == "always")
            self._appended.notify_all()
            return len(self._starts) - 1

    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _maybe_fsync(self, force: bool = False) -> None:
        if self.config.fsync == "never":
            return
        now = time.monotonic()
        if force or now - self._last_fsync >= self.config.fsync_interval_s:
            os.fsync(self._fd)
            self._last_fsync = now

    # -- indexing --------------------------------------------------------------------------------

    def _scan(self, truncate_torn_tail: bool) -> None:
        """Index the valid records after `self._end`. Caller holds `self._lock`.

        An invalid record with nothing after it is a torn (or in-progress) write: truncated when the
        caller holds the writer lock, otherwise left for later. One with data after it is corruption.
        """
        size = os.fstat(self._fd).st_size
        pos = self._end
        while pos < size:
            header = os.pread(self._fd, _HEADER.size, pos)
            if len(header) < _HEADER.size:
                break
            length, crc = _HEADER.unpack(header)
            end = pos + _HEADER.size + length
            if end > size:
                break  # incomplete: torn, or still being written
            if _record_crc(header[:4], self._pread_exact(pos + _HEADER.size, length)) != crc:
                if end < size:
                    raise CorruptLogError(
                        f"{self._log_path}: record {len(self._starts)} at byte {pos} fails its checksum and "
                        f"is followed by {size - end} more bytes; this is corruption, not a torn write. "
                        f"To keep the records before it, truncate the file to {pos} bytes."
                    )
                break
            self._starts.append(pos)
            pos = end
        self._end = pos
        if pos < size and truncate_torn_tail:
            os.ftruncate(self._fd, pos)
            os.fsync(self._fd)

    def _pread_exact(self, pos: int, length: int) -> bytes:
        chunks = []
        while length > 0:
            chunk = os.pread(self._fd, min(length, _SCAN_CHUNK_BYTES), pos)
            if not chunk:
                raise CorruptLogError(f"{self._log_path}: shrank while reading byte {pos}")
            chunks.append(chunk)
            pos += len(chunk)
            length -= len(chunk)
        return b"".join(chunks)

    # -- reading ---------------------------------------------------------------------------------

    def read(self, after: int, max_count: int, timeout_s: float) -> list[tuple[int, bytes]]:
        check_read_args(after, max_count, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._appended:
            while True:
                self._check_open()
                self._scan(truncate_torn_tail=False)  # other processes' appends
                first = after + 1
                if first < len(self._starts):
                    last = min(first + max_count, len(self._starts))
                    stop = self._starts[last] if last < len(self._starts) else self._end
                    return self._decode(
                        first, last, self._pread_exact(self._starts[first], stop - self._starts[first])
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # In-process appends notify; another process's appends are seen at the next poll.
                self._appended.wait(min(remaining, self.config.poll_interval_s))

    def _decode(self, first: int, last: int, data: bytes) -> list[tuple[int, bytes]]:
        out = []
        base = self._starts[first]
        view = memoryview(data)
        for offset in range(first, last):
            pos = self._starts[offset] - base
            length, crc = _HEADER.unpack_from(view, pos)
            payload = view[pos + _HEADER.size : pos + _HEADER.size + length]
            # Re-checked on every read: the page cache can lose unsynced data on power loss.
            if _record_crc(view[pos : pos + 4].tobytes(), payload) != crc:
                raise CorruptLogError(f"{self._log_path}: record {offset} fails its checksum on read")
            out.append((offset, payload.tobytes()))
        return out

    # -- consumers -------------------------------------------------------------------------------

    def commit(self, consumer: str, offset: int) -> None:
        check_consumer(consumer)
        with self._lock:
            self._check_open()
            self._scan(truncate_torn_tail=False)
            if not NO_OFFSET <= offset < len(self._starts):
                raise ValueError(
                    f"commit({consumer!r}, {offset}): offset must be in [-1, {len(self._starts) - 1}]"
                )
            # A committed offset must never point past durable records: sync the log first.
            self._maybe_fsync(force=True)
        path = self.directory / CONSUMERS_DIR / f"{consumer}.offset"
        tmp = path.with_name(f".{consumer}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(f"{offset}\n")
        if self.config.fsync != "never":
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old offset or the new one, never a mix
        if self.config.fsync != "never":
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def committed(self, consumer: str) -> int:
        check_consumer(consumer)
        path = self.directory / CONSUMERS_DIR / f"{consumer}.offset"
        try:
            text = path.read_text()
        except FileNotFoundError:
            return NO_OFFSET
        try:
            return int(text)
        except ValueError:
            raise CorruptLogError(f"{path}: expected an integer offset, found {text[:40]!r}") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.config.fsync != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.url} is closed")
