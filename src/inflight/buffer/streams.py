"""The `Stream` interface between pipeline stages, and `open_stream(url)` that picks a backend.

A stream is an append-only sequence of byte records with dense integer offsets 0, 1, 2, ... and named
consumer positions; `trim` drops a prefix that no reader needs any more, leaving the offsets of the rest as
they were. Backends (one file each): `memory://name`, `file:///path/dir`, `redis://host:port/db?key=name`.
It knows nothing of what the records mean (see `codec` for RolloutGroups) nor who decides what to trim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self
from urllib.parse import parse_qs, urlsplit

from inflight.errors import UserError

NO_OFFSET = -1  # `committed` of a consumer that never committed; `read(after=NO_OFFSET)` starts at 0


class TrimmedError(LookupError):
    """A read from an offset that `trim` dropped: the caller asked for records it had declared unneeded."""

    def __init__(self, url: str, first: int, first_kept: int) -> None:
        super().__init__(
            f"{url}: cannot read from offset {first}: the records before offset {first_kept} were trimmed "
            "(a checkpoint had made them unnecessary); read from a position at or after it"
        )


class Stream(ABC):
    """Append-only records with offsets and committed consumer positions. Every method is thread-safe.

    Ordering contract: offsets are dense and increase in append order; `read` returns records in offset
    order; a record whose `append` returned is visible to every reader of the same stream, also after a
    reopen (durability beyond a process crash depends on the backend: see each one).
    """

    url: str

    @abstractmethod
    def append(self, record: bytes) -> int:
        """Append one record; returns its offset."""

    @abstractmethod
    def read(self, after: int, max_count: int, timeout_s: float) -> list[tuple[int, bytes]]:
        """Up to `max_count` records with offset > `after`, oldest first. Waits up to `timeout_s` for the
        first one; returns [] when none came (a timeout is normal here: the caller decides what it means)."""

    @abstractmethod
    def commit(self, consumer: str, offset: int) -> None:
        """Record that `consumer` has processed every record up to and including `offset`."""

    @abstractmethod
    def committed(self, consumer: str) -> int:
        """The last offset `consumer` committed, or NO_OFFSET (-1) if it never did."""

    @abstractmethod
    def trim(self, before: int) -> None:
        """Let go of the records with offsets below `before` (`before` past the last record: all of them).
        Every record at or after `before` stays, at its offset, and appends go on where they were. A backend
        may keep some records below `before` (the file log deletes whole segment files only); a read from
        below the first record still kept raises TrimmedError."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and files; the stream's data stays where the backend keeps it."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def check_read_args(after: int, max_count: int, timeout_s: float) -> None:
    if after < NO_OFFSET:
        raise ValueError(f"read(after={after}): after must be >= -1 (-1 reads from the first record)")
    if max_count < 1:
        raise ValueError(f"read(max_count={max_count}): max_count must be >= 1")
    if not timeout_s >= 0:
        raise ValueError(f"read(timeout_s={timeout_s}): timeout_s must be >= 0")


def check_consumer(consumer: str) -> None:
    # Consumer names become file names (file backend) and hash fields (redis): keep them portable.
    if not consumer or len(consumer) > 128 or not all(c.isalnum() or c in "-_." for c in consumer):
        raise ValueError(f"consumer name {consumer!r} must be 1-128 characters of [A-Za-z0-9._-]")
    if consumer.startswith("."):
        raise ValueError(f"consumer name {consumer!r} must not start with '.'")


def query_options(query: str, allowed: set[str], url: str) -> dict[str, str]:
    """`a=1&b=2` -> {a: "1", b: "2"}; unknown or repeated keys are errors that list the valid ones."""
    options: dict[str, str] = {}
    for key, values in parse_qs(query, keep_blank_values=True).items():
        if key not in allowed:
            raise UserError(f"stream url {url!r}: unknown option {key!r}; valid: {sorted(allowed)}")
        if len(values) != 1:
            raise UserError(f"stream url {url!r}: option {key!r} given {len(values)} times")
        options[key] = values[0]
    return options


def open_stream(url: str) -> Stream:
    """Open (creating if needed) the stream at `url`:

    - `memory://name`: in this process; every open of the same name shares the records.
    - `file:///abs/dir?fsync=interval&fsync_interval_s=1&segment_bytes=4194304`: an append-only log of
      checksummed records in segment files in `dir` (a trim deletes whole ones) and consumer offsets in
      small files (fsync: always | interval | never).
    - `redis://host:port/db?key=name`: a Redis stream (Redis >= 7) plus a hash of committed offsets.
    """
    scheme = urlsplit(url).scheme
    # Backends are imported here so that using one never imports another's client library.
    if scheme == "memory":
        from inflight.buffer.memory_stream import MemoryStream

        return MemoryStream.from_url(url)
    if scheme == "file":
        from inflight.buffer.file_stream import FileStream

        return FileStream.from_url(url)
    if scheme == "redis":
        from inflight.buffer.redis_stream import RedisStream

        return RedisStream.from_url(url)
    raise UserError(f"stream url {url!r}: unknown scheme {scheme!r}; use memory://, file:// or redis://")
