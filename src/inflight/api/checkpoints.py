"""Checkpoint storage: where `tinker://` paths live on disk, their rows, listing, deleting, publishing and
expiry (an expired checkpoint's files are deleted, its row kept, so asking for it says it expired).

Owns the directory layout under the state dir and the CheckpointRow lifecycle; the engine writes the
files (into a staging dir this module hands out) and knows nothing about names or paths.

Ownership: a checkpoint belongs to its model's tenant. The owner may do anything with it; another tenant
may read it (`reader=`: weights_info, sampling from it, loading it, an archive link) only while it is
published, and may never delete, publish, unpublish or expire it (`owner=`). To anyone else it does not
exist: the same CheckpointNotFoundError, with the same words, as a path never saved, and that before its
expiry is looked at, so neither a 410 nor a message confirms another tenant's path.

Layout: `{root}/{model_id}/{weights|sampler_weights}/{name}/` (the engine's PEFT-style files), with
`{root}/.staging/` for saves in progress: a save is renamed into place only once complete, so a crash
never leaves a half-written checkpoint under a real name.

Room (`StorageLimits`): a tenant's unexpired checkpoints, by their recorded size, stay within its quota, and
a save never leaves the root's disk with less than a floor free (the database and every other tenant's
saves need it). A save's size is known only once written, so `commit` is the exact check; `check_room`
refuses earlier, before anything is written, a save that cannot fit whatever its size.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session

from inflight.api.db import CheckpointRow, Database, ModelRow, utcnow
from inflight.api.ids import CheckpointPath, parse_checkpoint_path
from inflight.errors import UserError

_FOLDERS = {"state": "weights", "sampler": "sampler_weights"}
_MAKE_ROOM = (
    "delete checkpoints (DELETE /api/v1/training_runs/{model_id}/checkpoints/{folder}/{name}, or the SDK's "
    "RestClient.delete_checkpoint_from_tinker_path; GET /api/v1/checkpoints lists yours) or save with a TTL "
    "(ttl_seconds)"
)


class CheckpointNotFoundError(UserError, LookupError):
    """No (unexpired) checkpoint has this path (routes answer 404)."""


class CheckpointExpiredError(UserError, LookupError):
    """The checkpoint was saved with a TTL that has run out (routes answer 410 Gone)."""


class CheckpointExistsError(UserError, ValueError):
    """A save would replace an existing checkpoint without `overwrite`."""


class CheckpointQuotaError(UserError):
    """A save that would take its tenant over its quota, or the server's disk under its floor: the user's
    to fix (make room), or the operator's (raise the quota, free the disk)."""


@dataclass(frozen=True)
class StorageLimits:
    """What checkpoints may take of the disk (ServiceConfig's max_checkpoint_bytes_per_key and
    min_free_disk_bytes say why). The defaults limit nothing."""

    max_bytes_per_tenant: int | None = None  # the recorded size of a tenant's unexpired checkpoints
    min_free_disk_bytes: int = 0  # left free on the root's filesystem after a save; 0: no floor


@dataclass(frozen=True)
class StoredCheckpoint:
    path: CheckpointPath
    storage_dir: Path
    size_bytes: int | None
    created_at: datetime
    expires_at: datetime | None
    public: bool = False
    owner: str = ""  # the tenant of the model that saved it


@dataclass(frozen=True)
class CheckpointSource:
    """What a checkpoint was trained from, so a load can rebuild the model that wrote it."""

    checkpoint: StoredCheckpoint
    base_model: str
    lora_config: dict[str, object]


def _stored(row: CheckpointRow) -> StoredCheckpoint:
    return StoredCheckpoint(
        path=parse_checkpoint_path(row.tinker_path),
        storage_dir=Path(row.storage_dir),
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        expires_at=row.expires_at,
        public=row.published_at is not None,
        owner=row.tenant,
    )


def _live(row: CheckpointRow | None, now: datetime) -> bool:
    return row is not None and (row.expires_at is None or row.expires_at > now)


def _unexpired(now: datetime) -> ColumnElement[bool]:
    """`_live` in SQL."""
    return or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now)


def _bytes_used(session: Session, tenant: str, now: datetime) -> int:
    used = session.scalar(
        select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
            CheckpointRow.tenant == tenant, _unexpired(now)
        )
    )
    return int(used or 0)  # PostgreSQL sums a BIGINT as NUMERIC


def _size(n_bytes: int) -> str:
    """For a reader: GiB, or MiB below one (the tiny model's checkpoints), or bytes below that."""
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:.2f} GiB"
    return f"{n_bytes / 2**20:.2f} MiB" if n_bytes >= 2**20 else f"{n_bytes:,} bytes"


def not_found_error(path: CheckpointPath | str) -> CheckpointNotFoundError:
    """What asking for a checkpoint one may not see answers: the words of one never saved."""
    return CheckpointNotFoundError(f"no checkpoint {path}: it was never saved, or was deleted")


def _visible(row: CheckpointRow | None, tenant: str | None, *, published_ok: bool) -> bool:
    """Whether `tenant` may see `row` at all: its owner, or (`published_ok`) anyone while it is published.
    `tenant` None: the server itself (the worker, a signed link), which sees everything."""
    if row is None:
        return False
    return tenant is None or row.tenant == tenant or (published_ok and row.published_at is not None)


def _live_row(
    session: Session, path: CheckpointPath, now: datetime, tenant: str | None, *, published_ok: bool
) -> CheckpointRow:
    """The row of an unexpired checkpoint `tenant` may see (`_visible`), or the error that says why there
    is none: not found first, so another tenant's expired checkpoint answers as one never saved."""
    row = session.get(CheckpointRow, str(path))
    if row is None or not _visible(row, tenant, published_ok=published_ok):
        raise not_found_error(path)
    if not _live(row, now):
        assert row.expires_at is not None
        raise CheckpointExpiredError(
            f"checkpoint {path} expired at {row.expires_at.isoformat(timespec='seconds')}: its ttl_seconds "
            "ran out and its files are deleted; save it again, with a longer ttl_seconds or none"
        )
    return row


class CheckpointStore:
    def __init__(self, db: Database, root: Path, limits: StorageLimits | None = None) -> None:
        self.db = db
        self.root = root
        self.limits = limits or StorageLimits()
        self._staging_root = root / ".staging"

    def discard_staging(self) -> None:
        """On start: saves a dead server left half-written are garbage."""
        shutil.rmtree(self._staging_root, ignore_errors=True)

    def staging_dir(self) -> Path:
        """A fresh, not yet existing directory for the engine to write a checkpoint into."""
        self._staging_root.mkdir(parents=True, exist_ok=True)
        return self._staging_root / uuid.uuid4().hex

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """`staging_dir`, removed on the way out: a save that failed or was refused leaves nothing on the
        disk (one `commit` moved into place is no longer there to remove)."""
        staged = self.staging_dir()
        try:
            yield staged
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def final_dir(self, path: CheckpointPath) -> Path:
        return self.root / path.model_id / _FOLDERS[path.kind] / path.name

    def exists(self, path: CheckpointPath) -> bool:
        with self.db.read() as session:
            return _live(session.get(CheckpointRow, str(path)), utcnow())

    def bytes_used(self, tenant: str) -> int:
        """The recorded size of `tenant`'s unexpired checkpoints: what its quota counts."""
        with self.db.read() as session:
            return _bytes_used(session, tenant, utcnow())

    def check_room(self, tenant: str, path: CheckpointPath | None, *, overwrite: bool) -> None:
        """Refuse (CheckpointQuotaError) a save by `tenant` that cannot fit whatever its size, before it is
        written: its tenant at or over its quota, counting the checkpoint an `overwrite` of `path` replaces
        as freed, or the disk under its floor already. `commit` checks again, exactly."""
        quota, floor = self.limits.max_bytes_per_tenant, self.limits.min_free_disk_bytes
        if quota is not None:
            now = utcnow()
            with self.db.read() as session:
                used = _bytes_used(session, tenant, now)
                replaced = session.get(CheckpointRow, str(path)) if path is not None and overwrite else None
                freed = (replaced.size_bytes or 0) if replaced is not None and _live(replaced, now) else 0
            if used - freed >= quota:
                raise CheckpointQuotaError(
                    f"no room for checkpoint {path or '(unnamed)'}: this API key's checkpoints take "
                    f"{_size(used)} of its {_size(quota)} quota; {_MAKE_ROOM}, or ask the operator to raise "
                    "--max-checkpoint-gib-per-key"
                )
        if floor > 0 and (free := self._free_disk_bytes()) < floor:
            raise CheckpointQuotaError(
                f"no room for checkpoint {path or '(unnamed)'}: the server's disk has {_size(free)} free, "
                f"under the {_size(floor)} it keeps free for its database and every key's saves; "
                f"{_MAKE_ROOM}, or ask the operator to free space on the server's disk"
            )

    def _refuse_unless_room(
        self, session: Session, path: CheckpointPath, tenant: str, size_bytes: int, freed_bytes: int
    ) -> None:
        """`check_room` once the save is written (`size_bytes`, on the disk already) and would replace a
        live checkpoint of `freed_bytes`."""
        quota, floor = self.limits.max_bytes_per_tenant, self.limits.min_free_disk_bytes
        if quota is not None:
            used = _bytes_used(session, tenant, utcnow())
            after = used - freed_bytes + size_bytes
            if after > quota:
                raise CheckpointQuotaError(
                    f"checkpoint {path} ({_size(size_bytes)}) would take this API key's checkpoints to "
                    f"{_size(after)}, over its {_size(quota)} quota ({_size(used)} used); {_MAKE_ROOM}, or "
                    "ask the operator to raise --max-checkpoint-gib-per-key"
                )
        if floor > 0 and (free := self._free_disk_bytes() + freed_bytes) < floor:
            raise CheckpointQuotaError(
                f"checkpoint {path} ({_size(size_bytes)}) would leave the server's disk {_size(free)} free, "
                f"under the {_size(floor)} it keeps free for its database and every key's saves; "
                f"{_MAKE_ROOM}, or ask the operator to free space on the server's disk"
            )

    def _free_disk_bytes(self) -> int:
        """Free on the root's filesystem (its nearest existing parent's, before the first save)."""
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        return shutil.disk_usage(where).free

    def commit(
        self,
        path: CheckpointPath,
        staged: Path,
        *,
        size_bytes: int,
        ttl_seconds: int | None,
        overwrite: bool,
        tenant: str,
    ) -> StoredCheckpoint:
        """Move a finished save into place and record it, owned by `tenant` (its model's); the row is
        written last, so a crash in between leaves only a directory without a row, which the next save of
        that name replaces. Refused, its staged files removed, if it does not fit (`limits`): checked in
        the write transaction, so two saves cannot both take the last room."""
        final = self.final_dir(path)
        now = utcnow()
        with self.db.write() as session:
            row = session.get(CheckpointRow, str(path))
            if _live(row, now) and not overwrite:
                shutil.rmtree(staged, ignore_errors=True)
                raise CheckpointExistsError(
                    f"checkpoint {path} already exists; save under another name or pass overwrite=True"
                )
            freed = (row.size_bytes or 0) if row is not None and _live(row, now) else 0
            try:
                self._refuse_unless_room(session, path, tenant, size_bytes, freed)
            except CheckpointQuotaError:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            if final.exists():
                shutil.rmtree(final)
            final.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(final)
            if row is None:
                row = CheckpointRow(
                    tinker_path=str(path),
                    model_id=path.model_id,
                    kind=path.kind,
                    name=path.name,
                    tenant=tenant,
                )
                session.add(row)
            row.storage_dir = str(final)
            row.size_bytes = size_bytes
            row.created_at = now
            row.expires_at = None if ttl_seconds is None else now + timedelta(seconds=ttl_seconds)
            row.published_at = None  # a new save is private until published again
            session.flush()
            return _stored(row)

    def get(self, path: str | CheckpointPath, *, reader: str | None) -> StoredCheckpoint:
        """The unexpired checkpoint, if `reader` owns it or it is published (None: the server itself)."""
        parsed = parse_checkpoint_path(path) if isinstance(path, str) else path
        with self.db.read() as session:
            return _stored(_live_row(session, parsed, utcnow(), reader, published_ok=True))

    def set_public(self, path: CheckpointPath, public: bool, *, owner: str) -> StoredCheckpoint:
        """Publish or unpublish `owner`'s checkpoint; idempotent (the SDK retries a call whose answer it
        lost)."""
        now = utcnow()
        with self.db.write() as session:
            row = _live_row(session, path, now, owner, published_ok=False)
            if public and row.published_at is None:
                row.published_at = now
            elif not public:
                row.published_at = None
            return _stored(row)

    def set_ttl(self, path: CheckpointPath, ttl_seconds: int | None, *, owner: str) -> StoredCheckpoint:
        """Expire `owner`'s checkpoint `ttl_seconds` from now, or never (None)."""
        now = utcnow()
        with self.db.write() as session:
            row = _live_row(session, path, now, owner, published_ok=False)
            row.expires_at = None if ttl_seconds is None else now + timedelta(seconds=ttl_seconds)
            return _stored(row)

    def list_all(self, *, tenant: str, limit: int, offset: int) -> tuple[int, list[StoredCheckpoint]]:
        """Every unexpired checkpoint of `tenant`'s runs (not others' published ones: a listing is what
        one owns), newest first, one page; and how many there are."""
        live = and_(CheckpointRow.tenant == tenant, _unexpired(utcnow()))
        with self.db.read() as session:
            total = session.scalar(select(func.count()).select_from(CheckpointRow).where(live)) or 0
            rows = session.scalars(
                select(CheckpointRow)
                .where(live)
                .order_by(CheckpointRow.created_at.desc(), CheckpointRow.tinker_path)
                .offset(offset)
                .limit(limit)
            ).all()
            return total, [_stored(row) for row in rows]

    def source(self, path: str, *, reader: str | None) -> CheckpointSource:
        """What the checkpoint was trained from, if `reader` may read it (`get`)."""
        checkpoint = self.get(path, reader=reader)
        with self.db.read() as session:
            model = session.get(ModelRow, checkpoint.path.model_id)
            assert model is not None, "checkpoint rows reference their model (foreign key)"
            return CheckpointSource(checkpoint, model.base_model, dict(model.lora_config))

    def for_model(self, model_id: str) -> list[StoredCheckpoint]:
        now = utcnow()
        with self.db.read() as session:
            rows = session.scalars(
                select(CheckpointRow)
                .where(CheckpointRow.model_id == model_id)
                .order_by(CheckpointRow.created_at)
            ).all()
            return [_stored(row) for row in rows if _live(row, now)]

    def delete(self, path: CheckpointPath, *, owner: str) -> None:
        """Delete `owner`'s checkpoint, expired ones included (their row goes too)."""
        with self.db.write() as session:
            row = session.get(CheckpointRow, str(path))
            if row is None or not _visible(row, owner, published_ok=False):
                raise CheckpointNotFoundError(f"no checkpoint {path} to delete")
            storage_dir = row.storage_dir
            session.delete(row)
        if storage_dir:
            shutil.rmtree(storage_dir, ignore_errors=True)

    def delete_expired(self) -> int:
        """Delete the files of checkpoints past their TTL; their rows stay as the record that they expired."""
        now = utcnow()
        with self.db.write() as session:
            rows = session.scalars(
                select(CheckpointRow).where(CheckpointRow.expires_at <= now, CheckpointRow.storage_dir != "")
            ).all()
            dirs = [Path(row.storage_dir) for row in rows]
            for row in rows:
                row.storage_dir = ""
        for storage_dir in dirs:
            shutil.rmtree(storage_dir, ignore_errors=True)
        return len(dirs)
