"""RolloutGroup <-> JSON bytes for streams and buffer checkpoints: an exact round trip, floats included.

pydantic-core writes floats in their shortest round-trip form and validates the structure on the way back,
so a malformed record fails with an error naming the field. It knows nothing of where the bytes go.
"""

from __future__ import annotations

import pydantic_core
from pydantic import TypeAdapter, ValidationError

from inflight.types import RolloutGroup

_GROUP = TypeAdapter(RolloutGroup)


class CodecError(ValueError):
    """A record that is not a valid encoded RolloutGroup; the message names the field."""


def encode_group(group: RolloutGroup) -> bytes:
    """Compact JSON. NaN and +-inf are written as JSON5-style constants so they survive the round trip
    (a NaN logprob or reward is a bug worth seeing downstream, not something to turn into null)."""
    return pydantic_core.to_json(group, inf_nan_mode="constants")


def decode_group(data: bytes | str) -> RolloutGroup:
    # strict: a float where an int belongs (a token id of 3.0) or 1 for True means the writer is wrong.
    try:
        return _GROUP.validate_json(data, strict=True)
    except ValidationError as e:
        preview = bytes(data[:80]) if isinstance(data, bytes) else data[:80].encode()
        raise CodecError(f"record is not an encoded RolloutGroup ({preview!r}...): {e}") from e
