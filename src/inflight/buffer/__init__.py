"""Data between stages: streams (memory, file log, Redis) of encoded RolloutGroups, whose prefix is trimmed
once no reader needs it, and the version-aware RolloutBuffer (staleness bound by admission, oldest first,
active sampling)."""

from inflight.buffer.buffer import BufferCounters, RolloutBuffer
from inflight.buffer.codec import CodecError, decode_group, encode_group
from inflight.buffer.metrics import lag_histogram
from inflight.buffer.streams import NO_OFFSET, Stream, TrimmedError, open_stream

__all__ = [
    "NO_OFFSET",
    "BufferCounters",
    "CodecError",
    "RolloutBuffer",
    "Stream",
    "TrimmedError",
    "decode_group",
    "encode_group",
    "lag_histogram",
    "open_stream",
]
