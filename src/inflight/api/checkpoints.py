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
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from inflight.api.db import CheckpointRow, Database, ModelRow, utcnow
from inflight.api.ids import CheckpointPath, parse_checkpoint_path
from inflight.errors import UserError

_FOLDERS = {"state": "weights", "sampler": "sampler_weights"}


class CheckpointNotFoundError(UserError, LookupError):
    """No (unexpired) checkpoint has this path (routes answer 404)."""


class CheckpointExpiredError(UserError, LookupError):
    """The checkpoint was saved with a TTL that has run out (routes answer 410 Gone)."""


class CheckpointExistsError(UserError, ValueError):
    """A save would replace an existing checkpoint without `overwrite`."""


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
    def __init__(self, db: Database, root: Path) -> None:
        self.db = db
        self.root = root
        self._staging_root = root / ".staging"

    def discard_staging(self) -> None:
        """On start: saves a dead server left half-written are garbage."""
        shutil.rmtree(self._staging_root, ignore_errors=True)

    def staging_dir(self) -> Path:
        """A fresh, not yet existing directory for the engine to write a checkpoint into."""
        self._staging_root.mkdir(parents=True, exist_ok=True)
        return self._staging_root / uuid.uuid4().hex

    def final_dir(self, path: CheckpointPath) -> Path:
        return self.root / path.model_id / _FOLDERS[path.kind] / path.name

    def exists(self, path: CheckpointPath) -> bool:
        with self.db.read() as session:
            return _live(session.get(CheckpointRow, str(path)), utcnow())

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
        that name replaces."""
        final = self.final_dir(path)
        now = utcnow()
        with self.db.write() as session:
            row = session.get(CheckpointRow, str(path))
            if _live(row, now) and not overwrite:
                shutil.rmtree(staged, ignore_errors=True)
                raise CheckpointExistsError(
                    f"checkpoint {path} already exists; save under another name or pass overwrite=True"
                )
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
        now = utcnow()
        live = and_(
            CheckpointRow.tenant == tenant,
            or_(CheckpointRow.expires_at.is_(None), CheckpointRow.expires_at > now),
        )
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
