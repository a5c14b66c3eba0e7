"""Identifiers of the Tinker wire protocol: session, model and sampling-session ids, and checkpoint paths.

Owns their formats (spec §0.3, §9) and the parse errors users see; knows nothing about the database.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Literal

from inflight.errors import UserError

CheckpointKind = Literal["state", "sampler"]

# The SDK builds model ids itself as f"{session_id}:train:{model_seq_id}" (create_training_client_from_state),
# so session ids must not contain ':' or '/' (a '/' would break tinker:// path parsing).
_SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MODEL_ID = re.compile(r"(?P<session>[A-Za-z0-9_.-]{1,64}):train:(?P<seq>0|[1-9][0-9]{0,8})")
_PATH_DIRS: dict[str, CheckpointKind] = {"weights": "state", "sampler_weights": "sampler"}
# Names become directory names: no '/', and not '.' or '..'.
_CHECKPOINT_NAME = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9_.-]{1,128}")


class InvalidIdError(UserError, ValueError):
    """An id or path that does not have the documented shape; the message shows the expected one."""


def new_session_id() -> str:
    return f"session-{uuid.uuid4().hex[:16]}"


def new_sampling_session_id(session_id: str, sampling_session_seq_id: int) -> str:
    # Deterministic, so a retried create_sampling_session maps onto the same row.
    return f"{check_session_id(session_id)}:sample:{sampling_session_seq_id}"


def check_session_id(session_id: str) -> str:
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidIdError(
            f"invalid session_id {session_id!r}: expected 1-64 characters from [A-Za-z0-9_.-]"
        )
    return session_id


def model_id(session_id: str, model_seq_id: int) -> str:
    if model_seq_id < 0:
        raise InvalidIdError(f"invalid model_seq_id {model_seq_id}: must be >= 0")
    return f"{check_session_id(session_id)}:train:{model_seq_id}"


def parse_model_id(value: str) -> tuple[str, int]:
    """`"{session_id}:train:{model_seq_id}"` -> (session_id, model_seq_id)."""
    match = _MODEL_ID.fullmatch(value)
    if match is None:
        raise InvalidIdError(f"invalid model_id {value!r}: expected '{{session_id}}:train:{{model_seq_id}}'")
    return match["session"], int(match["seq"])


def check_model_id(value: str) -> str:
    parse_model_id(value)
    return value


@dataclass(frozen=True)
class CheckpointPath:
    """A parsed `tinker://{model_id}/{weights|sampler_weights}/{name}` (the SDK splits on '/': 3 parts)."""

    model_id: str
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        folder = "weights" if self.kind == "state" else "sampler_weights"
        return f"tinker://{self.model_id}/{folder}/{self.name}"


def checkpoint_path(model_id_: str, kind: CheckpointKind, name: str) -> CheckpointPath:
    check_model_id(model_id_)
    if not _CHECKPOINT_NAME.fullmatch(name):
        raise InvalidIdError(
            f"invalid checkpoint name {name!r}: expected 1-128 characters from [A-Za-z0-9_.-]"
        )
    return CheckpointPath(model_id_, kind, name)


def parse_checkpoint_path(value: str) -> CheckpointPath:
    expected = "expected 'tinker://{model_id}/weights/{name}' or 'tinker://{model_id}/sampler_weights/{name}'"
    if not value.startswith("tinker://"):
        raise InvalidIdError(f"invalid checkpoint path {value!r}: {expected}")
    parts = value.removeprefix("tinker://").split("/")
    if len(parts) != 3 or parts[1] not in _PATH_DIRS:
        raise InvalidIdError(f"invalid checkpoint path {value!r}: {expected}")
    try:
        return checkpoint_path(parts[0], _PATH_DIRS[parts[1]], parts[2])
    except InvalidIdError as err:
        raise InvalidIdError(f"invalid checkpoint path {value!r}: {err}") from None
