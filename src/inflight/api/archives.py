"""Checkpoint archives: signed, expiring download links, and the tar stream of a checkpoint's directory.

The SDKs that have `get_checkpoint_archive_url` fetch the URL it returns with a plain `urllib` request,
without the X-API-Key header, so the link carries its own credential: an HMAC of the checkpoint's path and
the link's expiry under a secret that lives only in this server process (a restart voids every link).
A link given to a tenant that does not own the checkpoint (it may read it only while it is published) is
signed as such (`shared`), with the same URL, so its download can ask whether the checkpoint is still
published. Knows nothing about HTTP routes or the database; the routes check the checkpoint itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import BinaryIO

from inflight.api.ids import CheckpointPath
from inflight.errors import UserError

ARCHIVE_LINK_LIFETIME = timedelta(minutes=15)  # what the SDK assumes when a server gives no expiry
COMPLETE_MARKER = "checkpoint_complete"  # the SDK's `checkpoint download` refuses an archive without it
_CHUNK_BYTES = 1 << 20


class ArchiveLinkError(UserError, PermissionError):
    """A download link that is not one this server signed, or whose time ran out (routes answer 403)."""


@dataclass(frozen=True)
class ArchiveLink:
    expires: datetime
    signature: str
    shared: bool = False  # given to a tenant other than the owner: good only while the checkpoint is public


class ArchiveSigner:
    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def sign(self, path: CheckpointPath, expires: datetime, *, shared: bool = False) -> ArchiveLink:
        expires = expires.replace(microsecond=0)  # the link carries whole seconds
        return ArchiveLink(expires, self._signature(path, int(expires.timestamp()), shared), shared)

    def verify(self, path: CheckpointPath, expires_unix: int, signature: str, now: datetime) -> bool:
        """Whether the link is a shared one (ArchiveLinkError unless this server signed it, either way, and
        it has not expired)."""
        given = signature.encode()
        # Both compared, in constant time, whichever matches: timing says nothing about the kind.
        matches = [
            hmac.compare_digest(given, self._signature(path, expires_unix, shared).encode())
            for shared in (False, True)
        ]
        if not any(matches):
            raise ArchiveLinkError(
                f"the download link of {path} is not valid (a wrong signature, or one signed before the "
                "server restarted): ask for a new one with get_checkpoint_archive_url"
            )
        if now.timestamp() >= expires_unix:
            expired = datetime.fromtimestamp(expires_unix, UTC).isoformat()
            raise ArchiveLinkError(
                f"the download link of {path} expired at {expired}: ask for a new one with "
                "get_checkpoint_archive_url"
            )
        return matches[1]

    def _signature(self, path: CheckpointPath, expires_unix: int, shared: bool) -> str:
        # The owner's links keep the message they always had; a shared link's differs by a last line.
        message = f"{path}\n{expires_unix}" + ("\nshared" if shared else "")
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()


class TarStream:
    """An uncompressed tar of the regular files directly in `directory`, plus an empty COMPLETE_MARKER,
    streamed without building it on disk. Files are opened up front, so `size` is exact and a checkpoint
    deleted or replaced mid-download still streams whole."""

    def __init__(self, directory: Path) -> None:
        self._members: list[tuple[tarfile.TarInfo, BinaryIO | None]] = []
        try:
            for path in sorted(directory.iterdir()):
                if path.is_file() and not path.is_symlink():
                    handle = path.open("rb")
                    self._members.append((_info(path.name, os.fstat(handle.fileno())), handle))
        except BaseException:
            self.close()
            raise
        self._members.append((_info(COMPLETE_MARKER, None), None))
        body = sum(tarfile.BLOCKSIZE + _padded(info.size) for info, _ in self._members)
        self.size = _padded(body + 2 * tarfile.BLOCKSIZE, tarfile.RECORDSIZE)

    def __iter__(self) -> Iterator[bytes]:
        written = 0
        try:
            for info, handle in self._members:
                header = info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")
                yield header
                left = info.size
                while handle is not None and left > 0:
                    chunk = handle.read(min(_CHUNK_BYTES, left))
                    if not chunk:
                        raise OSError(f"{info.name} shrank while it was being archived")
                    left -= len(chunk)
                    yield chunk
                padding = _padded(info.size) - info.size
                yield tarfile.NUL * padding
                written += len(header) + info.size + padding
            yield tarfile.NUL * (self.size - written)  # two zero blocks, then up to a whole record
        finally:
            self.close()

    def close(self) -> None:
        for _, handle in self._members:
            if handle is not None:
                handle.close()


def _info(name: str, stat: os.stat_result | None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = stat.st_size if stat is not None else 0
    info.mtime = int(stat.st_mtime) if stat is not None else 0
    info.mode = 0o644
    return info


def _padded(size: int, block: int = tarfile.BLOCKSIZE) -> int:
    return -(-size // block) * block
