"""`redis://host:port/db?key=NAME`: a Redis stream (XADD/XREAD) plus a hash of committed offsets.

Record offset n is stored under the stream entry id `0-(n+1)`: `XADD key 0-*` lets Redis (>= 7.0) pick
the next sequence number atomically, so concurrent writers in any process get dense offsets without a
script. `trim` is `XTRIM MINID`: Redis keeps the stream's last id when entries go (an emptied stream too),
so offsets never restart. Committed offsets live in the hash `NAME:offsets`. Durability is whatever the
Redis server's persistence (AOF/RDB) provides; it knows nothing of what the records mean.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import redis

from inflight.buffer.streams import (
    NO_OFFSET,
    Stream,
    TrimmedError,
    check_consumer,
    check_read_args,
    query_options,
)
from inflight.errors import UserError

_FIELD = b"d"
# One XREAD blocks at most this long, so the socket timeout below can bound every call.
_MAX_BLOCK_S = 10.0
_SOCKET_TIMEOUT_S = _MAX_BLOCK_S + 20.0
_CONNECT_TIMEOUT_S = 5.0
_MIN_VERSION = (7, 0)  # `XADD key 0-*` (explicit time part, auto sequence) arrived in Redis 7.0


def _entry_offset(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    time_part, _, seq = text.partition("-")
    if time_part != "0":
        raise RuntimeError(f"stream entry {text!r} was not written by inflight (expected an id 0-N)")
    return int(seq) - 1


class RedisStream(Stream):
    def __init__(self, host: str, port: int, db: int, key: str) -> None:
        if not key:
            raise UserError("redis stream needs a key: redis://host:port/db?key=NAME")
        self.url = f"redis://{host}:{port}/{db}?key={key}"
        self._key = key
        self._offsets_key = f"{key}:offsets"
        # The client's connection pool makes it thread-safe: a blocked XREAD holds its own connection.
        self._client = redis.Redis(
            host=host,
            port=port,
            db=db,
            socket_connect_timeout=_CONNECT_TIMEOUT_S,
            socket_timeout=_SOCKET_TIMEOUT_S,
        )
        try:
            info: dict[str, Any] = self._client.info("server")
        except redis.exceptions.ConnectionError as e:
            self._client.close()
            raise UserError(f"cannot reach Redis for stream {self.url}: {e}") from e
        version = tuple(int(p) for p in str(info["redis_version"]).split(".")[:2])
        if version < _MIN_VERSION:
            self._client.close()
            raise UserError(
                f"{self.url}: Redis {info['redis_version']} is too old; streams need Redis >= 7.0"
            )

    @classmethod
    def from_url(cls, url: str) -> RedisStream:
        parts = urlsplit(url)
        options = query_options(parts.query, {"key"}, url)
        db_text = parts.path.strip("/") or "0"
        if not db_text.isdigit():
            raise UserError(
                f"stream url {url!r}: the path must be a database number, e.g. redis://host:6379/0"
            )
        return cls(parts.hostname or "127.0.0.1", parts.port or 6379, int(db_text), options.get("key", ""))

    def append(self, record: bytes) -> int:
        return _entry_offset(self._client.xadd(self._key, {_FIELD: bytes(record)}, id="0-*"))

    def read(self, after: int, max_count: int, timeout_s: float) -> list[tuple[int, bytes]]:
        check_read_args(after, max_count, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            # BLOCK 0 would mean "forever" to Redis: a zero timeout is a plain non-blocking read.
            block_ms = int(min(remaining, _MAX_BLOCK_S) * 1000) if remaining > 0 else None
            reply: Any = self._client.xread(
                {self._key: f"0-{after + 1}"}, count=max_count, block=block_ms or None
            )
            if reply:
                _, entries = reply[0]
                records = [(_entry_offset(entry_id), fields[_FIELD]) for entry_id, fields in entries]
                if records[0][0] != after + 1:  # offsets are dense: a gap is a trimmed prefix
                    raise TrimmedError(self.url, after + 1, records[0][0])
                return records
            if deadline - time.monotonic() <= 0:
                first_kept, _ = self._bounds()
                if after + 1 < first_kept:  # nothing there to show a gap: ask where the stream starts
                    raise TrimmedError(self.url, after + 1, first_kept)
                return []

    def commit(self, consumer: str, offset: int) -> None:
        check_consumer(consumer)
        _, end = self._bounds()
        if not NO_OFFSET <= offset < end:
            raise ValueError(f"commit({consumer!r}, {offset}): offset must be in [-1, {end - 1}]")
        self._client.hset(self._offsets_key, consumer, offset)

    def _bounds(self) -> tuple[int, int]:
        """The offset of the first record still kept, and the one the next append gets (XLEN counts only
        what trims left). Both the next append's when the stream holds nothing."""
        try:
            info: Any = self._client.xinfo_stream(self._key)
        except redis.exceptions.ResponseError:  # no such key: nothing appended yet
            return 0, 0
        end = _entry_offset(info["last-generated-id"]) + 1
        first_entry = info["first-entry"]
        return (_entry_offset(first_entry[0]) if first_entry else end), end

    def committed(self, consumer: str) -> int:
        check_consumer(consumer)
        value = self._client.hget(self._offsets_key, consumer)
        return NO_OFFSET if value is None else int(value)

    def trim(self, before: int) -> None:
        # Exact (not `~`): the entries at or after `before` stay, and every one below goes now.
        if before > 0:
            self._client.xtrim(self._key, minid=f"0-{before + 1}", approximate=False)

    def close(self) -> None:
        self._client.close()
