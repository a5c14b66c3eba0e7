"""The service database (api/db.py) and wire ids (api/ids.py) on SQLite files under tmp_path.

Reference: /work/shared/reference/tinker-api.md §0.3 (model ids), §9 (checkpoint paths), §12 (SkyRL's tables).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from inflight.api import ids
from inflight.api.db import (
    CheckpointRow,
    Database,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    sqlite_url,
    utcnow,
)
from inflight.errors import UserError


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(sqlite_url(tmp_path / "service.db"))
    yield database
    database.close()


def _add_session_and_model(db: Database, session_id: str = "s1", seq: int = 0) -> str:
    model_id = ids.model_id(session_id, seq)
    with db.write() as session:
        if session.get(SessionRow, session_id) is None:
            session.add(
                SessionRow(session_id=session_id, tags=["t"], user_metadata=None, sdk_version="0.38.0")
            )
            session.flush()  # the model's foreign key needs the session row first
        session.add(
            ModelRow(
                model_id=model_id,
                session_id=session_id,
                model_seq_id=seq,
                base_model="tiny",
                lora_rank=8,
                lora_config={"rank": 8, "seed": 0},
                user_metadata=None,
            )
        )
    return model_id


def test_sqlite_runs_in_wal_mode_with_busy_timeout_and_foreign_keys(db: Database) -> None:
    with db.read() as session:
        pragma = session.connection().exec_driver_sql
        assert pragma("PRAGMA journal_mode").scalar() == "wal"
        assert pragma("PRAGMA busy_timeout").scalar() == 30_000
        assert pragma("PRAGMA foreign_keys").scalar() == 1


def test_rows_round_trip_with_aware_utc_datetimes(db: Database) -> None:
    model_id = _add_session_and_model(db)
    path = str(ids.checkpoint_path(model_id, "state", "c1"))
    with db.write() as session:
        session.add(
            CheckpointRow(tinker_path=path, model_id=model_id, kind="state", name="c1", storage_dir="/x")
        )
        session.add(
            SamplingSessionRow(
                sampling_session_id=ids.new_sampling_session_id("s1", 0),
                session_id="s1",
                sampling_session_seq_id=0,
                base_model="tiny",
                model_path=None,
            )
        )
    with db.read() as session:
        model = session.get(ModelRow, model_id)
        assert (
            model is not None and model.status == "creating" and model.lora_config == {"rank": 8, "seed": 0}
        )
        checkpoint = session.scalars(select(CheckpointRow)).one()
        assert checkpoint.tinker_path == f"tinker://{model_id}/weights/c1"
        assert checkpoint.created_at.tzinfo == UTC
        assert abs((utcnow() - checkpoint.created_at).total_seconds()) < 60
        assert session.scalars(select(SamplingSessionRow)).one().sampling_session_id == "s1:sample:0"


def test_unique_and_foreign_key_constraints(db: Database) -> None:
    model_id = _add_session_and_model(db)
    with pytest.raises(IntegrityError):
        _add_session_and_model(db)  # same (session_id, model_seq_id)
    with pytest.raises(IntegrityError), db.write() as session:
        session.add(SessionRow(session_id="s2", user_metadata=None, sdk_version=None))
        session.flush()
        session.add(
            ModelRow(
                model_id="nope:train:0",
                session_id="nope",  # no such session
                model_seq_id=0,
                base_model="tiny",
                lora_rank=8,
                lora_config={},
                user_metadata=None,
            )
        )
    row = {"model_id": model_id, "kind": "sampler", "name": "s1", "storage_dir": "/x"}
    with db.write() as session:
        session.add(CheckpointRow(tinker_path="tinker://a/sampler_weights/s1", **row))
    with pytest.raises(IntegrityError), db.write() as session:
        session.add(CheckpointRow(tinker_path="tinker://b/sampler_weights/s1", **row))
    with db.read() as session:  # the failed transactions left nothing behind
        assert session.get(SessionRow, "s2") is None
        assert len(session.scalars(select(CheckpointRow)).all()) == 1


def test_rows_survive_reopening_the_file(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "service.db")
    first = Database(url)
    model_id = _add_session_and_model(first)
    first.close()
    second = Database(url)  # create_all on an existing schema is a no-op
    with second.read() as session:
        model = session.get(ModelRow, model_id)
        assert model is not None and model.lora_rank == 8
    second.close()


def test_a_database_written_before_a_column_was_added_opens_and_gains_it(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "service.db")
    first = Database(url)
    model_id = _add_session_and_model(first)
    path = f"tinker://{model_id}/weights/c1"
    with first.write() as session:
        session.add(
            CheckpointRow(tinker_path=path, model_id=model_id, kind="state", name="c1", storage_dir="/x")
        )
    with first.engine.begin() as connection:  # the checkpoints table as the version before publishing had it
        connection.exec_driver_sql("ALTER TABLE checkpoints DROP COLUMN published_at")
    first.close()
    second = Database(url)
    with second.read() as session:
        row = session.get(CheckpointRow, path)
        assert row is not None and row.published_at is None and row.storage_dir == "/x"
    with second.write() as session:
        session.get(CheckpointRow, path).published_at = utcnow()  # type: ignore[union-attr]
    second.close()


def test_sqlite_url_checks(tmp_path: Path) -> None:
    nested = Database(sqlite_url(tmp_path / "new" / "dir" / "service.db"))  # parent dirs are created
    nested.close()
    assert (tmp_path / "new" / "dir" / "service.db").exists()
    for url in ["sqlite://", "sqlite:///:memory:"]:
        with pytest.raises(ValueError, match="in-memory SQLite"):
            Database(url)


def test_a_reader_never_blocks_a_writer(db: Database) -> None:
    _add_session_and_model(db)
    with db.read() as reader:
        assert reader.get(SessionRow, "s1") is not None  # holds a WAL read snapshot open
        _add_session_and_model(db, seq=1)  # would time out if readers took the write lock
        assert reader.get(ModelRow, "s1:train:1") is None  # the snapshot is stable
    with db.read() as session:
        assert session.get(ModelRow, "s1:train:1") is not None


def test_naive_datetimes_are_rejected(db: Database) -> None:
    with pytest.raises(Exception, match="naive datetime"), db.write() as session:
        session.add(
            SessionRow(session_id="s", user_metadata=None, sdk_version=None, created_at=datetime(2026, 1, 1))
        )


def test_model_ids_and_checkpoint_paths() -> None:
    assert ids.model_id("s-1", 3) == "s-1:train:3"
    assert ids.parse_model_id("s-1:train:3") == ("s-1", 3)
    for bad in [
        "",
        "s1",
        "s1:train:",
        "s1:train:-1",
        "s1:train:01",
        "s/1:train:0",
        "a:b:train:0",
        "s1:sample:0",
    ]:
        with pytest.raises(UserError, match="invalid model_id"):
            ids.parse_model_id(bad)
    with pytest.raises(UserError, match="invalid session_id"):
        ids.model_id("a:b", 0)
    path = ids.checkpoint_path("s1:train:0", "sampler", "000020")
    assert str(path) == "tinker://s1:train:0/sampler_weights/000020"
    assert ids.parse_checkpoint_path(str(path)) == path
    assert ids.parse_checkpoint_path("tinker://s1:train:0/weights/final").kind == "state"
    for bad in [
        "s1:train:0/weights/final",
        "tinker://s1:train:0/weights",
        "tinker://s1:train:0/external_weights/x",
        "tinker://s1:train:0/weights/a/b",
        "tinker://nope/weights/final",
        "tinker://s1:train:0/weights/..",
        "tinker://s1:train:0/weights/a%2Fb",
    ]:
        with pytest.raises(UserError, match="invalid checkpoint path"):
            ids.parse_checkpoint_path(bad)
