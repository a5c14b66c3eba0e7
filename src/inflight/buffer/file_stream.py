"""`file:///dir`: an append-only log of checksummed records in segment files, plus consumer offsets.

Layout: `records-<offset of its first record, 20 digits>.log` segment files hold records as [u32 payload
length][u32 crc32(length bytes + payload)][payload]. Appends go to the last segment; a writer starts the
next one once it holds `segment_bytes`. `trim(before)` deletes the segments whose records all come before
`before`, so the log on disk is what its readers still need plus at most one segment; offsets are in the
file names and never change. `consumers/NAME.offset` holds one consumer's committed offset, replaced
atomically; `writer.lock` is an flock that serialises appends, new segments and deletions across processes.
A log of earlier versions (one `records.log`) becomes segment 0 when opened. It knows nothing of what the
records mean.

Crash contract: an append that returned survives a SIGKILL of any process (the bytes are in the page
cache); a power loss keeps what was fsynced (see `fsync`). A writer killed mid-append leaves a torn last
record; the next open or append, holding the lock, truncates it away. Only the last segment is ever
written to: a segment is whole (fsynced) before the next one is created, and a trim deletes oldest first
and never the last segment, so a kill at any point leaves a log that reopens with the same offsets.
Readers never return a record whose checksum fails, and treat an incomplete tail as "not written yet"
(another process may be mid-write).
"""

from __future__ import annotations

import bisect
import fcntl
import os
import re
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from inflight.buffer.streams import (
    NO_OFFSET,
    Stream,
    TrimmedError,
    check_consumer,
    check_read_args,
    query_options,
)
from inflight.durable import fsync_path
from inflight.errors import UserError

LEGACY_LOG_NAME = "records.log"  # the single log file of earlier versions
LOCK_NAME = "writer.lock"
CONSUMERS_DIR = "consumers"
_SEGMENT_NAME = re.compile(r"records-(\d{20})\.log")
_HEADER = struct.Struct("<II")  # payload length, crc32 over (length bytes + payload)
_SCAN_CHUNK_BYTES = 4 << 20


def segment_name(first_offset: int) -> str:
    """The file name of the segment whose first record has offset `first_offset`."""
    return f"records-{first_offset:020d}.log"


class FileStreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # always: fsync every append (survives power loss, slowest); interval: at most every fsync_interval_s
    # and on commit/close; never: leave it to the OS (still survives any process crash).
    fsync: Literal["always", "interval", "never"] = "interval"
    fsync_interval_s: float = 1.0
    # Cross-process readers notice other processes' appends by polling the file size this often.
    poll_interval_s: float = 0.02
    max_record_bytes: int = (1 << 32) - 1  # the u32 length field's limit
    # The next segment file starts once the last one holds this much. A trim deletes whole segments, so
    # up to this much that no reader needs stays on disk; smaller segments mean more files.
    segment_bytes: int = 4 << 20

    @model_validator(mode="after")
    def _check(self) -> FileStreamConfig:
        if self.fsync_interval_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("fsync_interval_s must be >= 0 and poll_interval_s > 0")
        if not 0 < self.max_record_bytes < 1 << 32:
            raise ValueError("max_record_bytes must be in [1, 2**32 - 1] (the record length is a u32)")
        if self.segment_bytes < 1:
            raise ValueError("segment_bytes must be >= 1")
        return self


class CorruptLogError(RuntimeError):
    """A record in the middle of the log fails its checksum, or a segment is missing or cut short: not a
    torn write, so nothing is truncated."""


def _record_crc(length_bytes: bytes, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(length_bytes))


@dataclass(eq=False)
class _Segment:
    """One segment file as this handle has indexed it."""

    first: int  # the offset of its first record (its name)
    path: Path
    fd: int
    starts: array[int] = field(default_factory=lambda: array("q"))  # byte position of each indexed record
    end: int = 0  # byte position just after the last indexed record
    sealed: bool = False  # a later segment exists, and this one was indexed to its end after it appeared

    @property
    def next_offset(self) -> int:
        return self.first + len(self.starts)


class FileStream(Stream):
    def __init__(self, directory: str | Path, config: FileStreamConfig | None = None) -> None:
        self.config = config or FileStreamConfig()
        self.directory = Path(directory)
        self.url = f"file://{self.directory.resolve()}"
        (self.directory / CONSUMERS_DIR).mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        self._segments: list[_Segment] = []  # oldest first, never empty once open; appends go to the last
        self._lock = threading.Lock()  # guards the index and the fds within this process
        self._appended = threading.Condition(self._lock)
        self._last_fsync = time.monotonic()
        self._closed = False
        with self._lock, self._writer_lock():
            self._adopt_legacy_log()
            self._refresh(writer=True)

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
            # Under the lock no other writer is mid-append, so an invalid tail is torn: cut it off first.
            self._refresh(writer=True)
            segment = self._segments[-1]
            if segment.starts and segment.end + len(data) > self.config.segment_bytes:
                segment = self._roll()
            start = segment.end
            try:
                view = memoryview(data)
                while view:  # os.write may write less than asked (signals, huge buffers)
                    view = view[os.write(segment.fd, view) :]
            except BaseException:
                os.ftruncate(segment.fd, start)  # never leave our own half record behind
                raise
            segment.starts.append(start)
            segment.end = start + len(data)
            self._maybe_fsync(force=self.config.fsync == "always")
            self._appended.notify_all()
            return segment.next_offset - 1

    def trim(self, before: int) -> None:
        with self._appended, self._writer_lock():
            self._refresh(writer=True)
            if self._segments[-1].starts and before >= self._segments[-1].next_offset:
                self._roll()  # every record goes: the last segment too, once it is not the last
            # Oldest first, and never the last segment: a kill part way leaves a valid log (module docstring).
            # A deletion needs no fsync: a segment back after a power loss holds only records nobody reads.
            while len(self._segments) > 1 and self._segments[1].first <= before:
                segment = self._segments.pop(0)
                segment.path.unlink(missing_ok=True)
                os.close(segment.fd)

    def _roll(self) -> _Segment:
        """Start the segment after the last one, which the caller indexed to its end under the writer lock.
        Its records are fsynced first: a segment on disk after it means that it is whole."""
        last = self._segments[-1]
        if self.config.fsync != "never":
            os.fsync(last.fd)
        last.sealed = True
        segment = self._create_segment(last.next_offset)
        self._segments.append(segment)
        return segment

    def _create_segment(self, first: int) -> _Segment:
        path = self.directory / segment_name(first)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if self.config.fsync != "never":
            fsync_path(self.directory)  # the new name too: after a power loss the offsets must go on
        return _Segment(first, path, fd)

    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        self._check_open()  # a closed handle has no fds: say so, not EBADF (the caller holds self._lock)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _maybe_fsync(self, force: bool = False) -> None:
        # Only the last segment can hold unsynced records: `_roll` synced the others.
        if self.config.fsync == "never":
            return
        now = time.monotonic()
        if force or now - self._last_fsync >= self.config.fsync_interval_s:
            os.fsync(self._segments[-1].fd)
            self._last_fsync = now

    def _adopt_legacy_log(self) -> None:
        """An earlier version's single `records.log` becomes segment 0. Caller holds both locks."""
        legacy = self.directory / LEGACY_LOG_NAME
        if not legacy.exists():
            return
        if any(_SEGMENT_NAME.fullmatch(name) for name in os.listdir(self.directory)):
            raise CorruptLogError(
                f"{self.directory} holds both {LEGACY_LOG_NAME} (an earlier version's log) and segment "
                f"files: move {LEGACY_LOG_NAME} away if the segments are this stream's records"
            )
        os.replace(legacy, self.directory / segment_name(0))

    # -- indexing --------------------------------------------------------------------------------

    def _refresh(self, writer: bool) -> None:
        """Bring the index up to date: segments other handles created or deleted, and the records appended
        since. Caller holds `self._lock`. `writer`: the caller also holds the writer lock, so the directory
        listing is the whole truth and the last segment's torn tail (if any) is cut off."""
        last_known = self._segments[-1].first if self._segments else -1
        listed = (_SEGMENT_NAME.fullmatch(name) for name in os.listdir(self.directory))
        for first in sorted(int(m[1]) for m in listed if m):
            if first <= last_known:
                continue
            path = self.directory / segment_name(first)
            try:
                fd = os.open(path, os.O_RDWR | os.O_APPEND)
            except FileNotFoundError:  # trimmed since the listing (a reader lists without the lock)
                continue
            self._segments.append(_Segment(first, path, fd))
        if not self._segments:  # a new stream (only a writer can see none: a trim keeps the last one)
            self._segments.append(self._create_segment(0))
        # Trims delete oldest first: the deleted segments are a prefix. A reader keeps its last one even
        # when deleted (records are still readable through its fd) until it lists the one that followed.
        while len(self._segments) > 1 and os.fstat(self._segments[0].fd).st_nlink == 0:
            os.close(self._segments.pop(0).fd)
        if writer and os.fstat(self._segments[-1].fd).st_nlink == 0:
            raise CorruptLogError(
                f"{self._segments[-1].path} was deleted while it was the last segment (a trim never does "
                "that): the stream's next offsets are unknown; move the directory away to start a new stream"
            )
        for i, segment in enumerate(self._segments):
            if segment.sealed:
                continue
            last = i == len(self._segments) - 1
            size = self._index(segment, truncate_torn_tail=writer and last)
            if last:
                break
            following = self._segments[i + 1]
            if segment.end != size or segment.next_offset != following.first:
                raise CorruptLogError(
                    f"{segment.path}: holds records {segment.first}..{segment.next_offset - 1} and "
                    f"{size - segment.end} more bytes, but the next segment starts at offset "
                    f"{following.first}; a segment is whole before the next one starts, so this is damage"
                )
            segment.sealed = True

    def _index(self, segment: _Segment, truncate_torn_tail: bool) -> int:
        """Index the valid records of `segment` after `segment.end`; returns the file's size after.

        An invalid record with nothing after it is a torn (or in-progress) write: truncated when the
        caller holds the writer lock, otherwise left for later. One with data after it is corruption.
        """
        size = os.fstat(segment.fd).st_size
        pos = segment.end
        while pos < size:
            header = os.pread(segment.fd, _HEADER.size, pos)
            if len(header) < _HEADER.size:
                break
            length, crc = _HEADER.unpack(header)
            end = pos + _HEADER.size + length
            if end > size:
                break  # incomplete: torn, or still being written
            if _record_crc(header[:4], _pread_exact(segment, pos + _HEADER.size, length)) != crc:
                if end < size:
                    raise CorruptLogError(
                        f"{segment.path}: record {segment.next_offset} at byte {pos} fails its checksum and "
                        f"is followed by {size - end} more bytes; this is corruption, not a torn write. "
                        f"To keep the records before it, truncate the file to {pos} bytes."
                    )
                break
            segment.starts.append(pos)
            pos = end
        segment.end = pos
        if pos < size and truncate_torn_tail:
            os.ftruncate(segment.fd, pos)
            os.fsync(segment.fd)
            size = pos
        return size

    # -- reading ---------------------------------------------------------------------------------

    def read(self, after: int, max_count: int, timeout_s: float) -> list[tuple[int, bytes]]:
        check_read_args(after, max_count, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._appended:
            while True:
                self._check_open()
                self._refresh(writer=False)  # other processes' appends, new segments and trims
                records = self._read_indexed(after + 1, max_count)
                if records:
                    return records
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # In-process appends notify; another process's appends are seen at the next poll.
                self._appended.wait(min(remaining, self.config.poll_interval_s))

    def _read_indexed(self, first: int, max_count: int) -> list[tuple[int, bytes]]:
        """Up to `max_count` indexed records from offset `first` on, across segments."""
        kept = self._segments[0].first
        if first < kept:
            raise TrimmedError(self.url, first, kept)
        out: list[tuple[int, bytes]] = []
        i = bisect.bisect_right([s.first for s in self._segments], first) - 1
        for segment in self._segments[i:]:
            lo = first + len(out) - segment.first
            hi = min(len(segment.starts), lo + max_count - len(out))
            if lo < hi:
                stop = segment.starts[hi] if hi < len(segment.starts) else segment.end
                data = _pread_exact(segment, segment.starts[lo], stop - segment.starts[lo])
                out.extend(_decode(segment, lo, hi, data))
            if len(out) == max_count:
                break
        return out

    # -- consumers -------------------------------------------------------------------------------

    def commit(self, consumer: str, offset: int) -> None:
        check_consumer(consumer)
        with self._lock:
            self._check_open()
            self._refresh(writer=False)
            end = self._segments[-1].next_offset
            if not NO_OFFSET <= offset < end:
                raise ValueError(f"commit({consumer!r}, {offset}): offset must be in [-1, {end - 1}]")
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
            fsync_path(path.parent)

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
                os.fsync(self._segments[-1].fd)
            for segment in self._segments:
                os.close(segment.fd)
            os.close(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.url} is closed")


def _decode(segment: _Segment, lo: int, hi: int, data: bytes) -> list[tuple[int, bytes]]:
    """Records lo..hi-1 of `segment` (indexes into it) from `data`, its bytes from record lo's start."""
    out = []
    base = segment.starts[lo]
    view = memoryview(data)
    for index in range(lo, hi):
        pos = segment.starts[index] - base
        length, crc = _HEADER.unpack_from(view, pos)
        payload = view[pos + _HEADER.size : pos + _HEADER.size + length]
        # Re-checked on every read: the page cache can lose unsynced data on power loss.
        if _record_crc(view[pos : pos + 4].tobytes(), payload) != crc:
            raise CorruptLogError(
                f"{segment.path}: record {segment.first + index} fails its checksum on read"
            )
        out.append((segment.first + index, payload.tobytes()))
    return out


def _pread_exact(segment: _Segment, pos: int, length: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(segment.fd, min(length, _SCAN_CHUNK_BYTES), pos)
        if not chunk:
            raise CorruptLogError(f"{segment.path}: shrank while reading byte {pos}")
        chunks.append(chunk)
        pos += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)
