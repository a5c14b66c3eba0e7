"""The service database: SQLAlchemy rows for sessions, models, futures, checkpoints and sampling sessions.

Owns the schema and connection setup (SQLite in WAL mode by default, any SQLAlchemy URL such as
PostgreSQL); knows nothing about the wire format or the engine. Only portable column types are used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, Session, mapped_column, sessionmaker
from sqlalchemy.schema import CreateColumn
from sqlalchemy.types import TypeDecorator

SQLITE_BUSY_TIMEOUT_MS = 30_000
_READ_ONLY = "inflight_read_only"  # execution option: start a deferred (shared) SQLite transaction


def utcnow() -> datetime:
    return datetime.now(UTC)


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend: SQLite stores no offset, PostgreSQL's timestamptz does."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the database: use inflight.api.db.utcnow()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite autoincrements only an INTEGER PRIMARY KEY (its rowid alias); elsewhere use 64 bits.
_RequestIdType = BigInteger().with_variant(Integer(), "sqlite")


def tenant_column(*, index: bool = False) -> MappedColumn[str]:
    """Who created the row: the tenant of the API key the request came with (`auth.tenant_of`), "" on a
    server without keys. Not null with a server default of "", so a database written before tenants
    existed gains the column with every old row in tenant "" (`_add_missing_columns`): visible to the
    keyless server that made them and to no key. Indexed where a listing filters on it; every other
    lookup is by primary key and compares it in Python."""
    return mapped_column(String(64), default="", server_default="", index=index)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UtcDateTime,
        dict[str, Any]: JSON,
        list[str]: JSON,
        bytes: LargeBinary,
    }


class SessionRow(Base):
    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tags: Mapped[list[str]] = mapped_column(default=list)
    user_metadata: Mapped[dict[str, Any] | None]
    sdk_version: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | finished
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_count: Mapped[int] = mapped_column(default=0)
    tenant: Mapped[str] = tenant_column()


# A model's status once its creation (create_model, or a create-via-load) failed: the client got that
# error, never the model's id, so it is no training run (not listed).
CREATION_FAILED = "failed"


class ModelRow(Base):
    """A training run: one LoRA adapter (and its optimizer state) on a base model."""

    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("session_id", "model_seq_id", name="uq_models_session_seq"),)

    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "{session_id}:train:{n}"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.session_id"))
    model_seq_id: Mapped[int]
    base_model: Mapped[str] = mapped_column(String(256))
    lora_rank: Mapped[int]
    lora_config: Mapped[dict[str, Any]]  # the full wire LoraConfig: seed, train_attn/mlp/unembed
    optimizer_type: Mapped[str] = mapped_column(String(32), default="adamw")
    # creating | ready | failed (CREATION_FAILED: no training run) | lost (live weights gone after a restart;
    # reload from a checkpoint) | unloaded (its session finished)
    status: Mapped[str] = mapped_column(String(16), default="creating")
    user_metadata: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    tenant: Mapped[str] = tenant_column(index=True)  # list_training_runs lists one tenant's


class FutureRow(Base):
    """One submitted request. `model_id` is the namespace its `seq_id` counts in: the training model, or
    the sampling session for samples. The unique pair makes a retried submission land on the same row."""

    __tablename__ = "futures"
    __table_args__ = (
        UniqueConstraint("model_id", "seq_id", name="uq_futures_model_seq"),
        Index("ix_futures_status_model", "status", "model_id"),
        # Each tenant's pending samples, oldest first, a seek each (FutureStore.pending_unordered_by_tenant).
        Index("ix_futures_pending_tenant", "status", "request_type", "tenant", "request_id"),
        # AUTOINCREMENT: SQLite must never hand out a request_id again, or an old poll gets a new result.
        {"sqlite_autoincrement": True},
    )

    request_id: Mapped[int] = mapped_column(_RequestIdType, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(String(128))
    # None only for unordered requests without a counter (legacy samples). 64-bit: sampling clones
    # number their seq_ids from 1e9 * k.
    seq_id: Mapped[int | None] = mapped_column(BigInteger)
    request_type: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # pending | running | done | failed
    request_payload: Mapped[bytes]
    payload_sha256: Mapped[str] = mapped_column(String(64))
    result_payload: Mapped[bytes | None]
    error: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(String(16))  # user | server
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    tenant: Mapped[str] = tenant_column()  # retrieve_future and cancel_future answer only their creator


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "kind", "name", name="uq_checkpoints_model_kind_name"),)

    tinker_path: Mapped[str] = mapped_column(String(512), primary_key=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.model_id"))
    kind: Mapped[str] = mapped_column(String(16))  # state (adapter + optimizer) | sampler (adapter only)
    name: Mapped[str] = mapped_column(String(128))
    # "" once an expired checkpoint's files are gone: the row stays, so asking for it says it expired.
    storage_dir: Mapped[str] = mapped_column(String(1024))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    published_at: Mapped[datetime | None]  # set while the checkpoint is public (publish / unpublish)
    # Its model's tenant: the owner, the only one who may delete, publish or expire it; others may read it
    # (weights_info, sample, load, download) while it is published.
    tenant: Mapped[str] = tenant_column(index=True)


class SamplingSessionRow(Base):
    __tablename__ = "sampling_sessions"
    __table_args__ = (
        UniqueConstraint("session_id", "sampling_session_seq_id", name="uq_sampling_sessions_session_seq"),
    )

    sampling_session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.session_id"))
    sampling_session_seq_id: Mapped[int]
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(512))  # None: the bare base model
    # Set for sessions made by an ephemeral save_weights_for_sampler: the engine key of an in-memory
    # snapshot of the adapter (lost on restart, unlike a model_path checkpoint).
    snapshot_key: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    tenant: Mapped[str] = tenant_column()


def _configure_sqlite(engine: Engine) -> None:
    # pysqlite's own implicit BEGIN is deferred: two connections can both read and then both try to write,
    # and one fails at once with SQLITE_BUSY that no busy timeout can fix. Take the write lock up front
    # (BEGIN IMMEDIATE) instead; read-only sessions keep a deferred BEGIN so WAL readers never block.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        # NORMAL loses no committed transaction when the process dies (kill -9), only on power loss.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        read_only = connection.get_execution_options().get(_READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def _prepare_sqlite_file(url: str) -> None:
    path = make_url(url).database
    # Every pooled connection to an in-memory SQLite database sees a different, empty database.
    if not path or path == ":memory:":
        raise ValueError(f"in-memory SQLite ({url!r}) cannot hold the service state: use sqlite:///PATH")
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def _add_missing_columns(engine: Engine) -> None:
    """The one kind of migration so far: a column added to an existing table (nullable, or not null with a
    server default that fills the old rows) is added with ALTER TABLE, and an index missing from an existing
    table is created (`create_all` skips the indexes of tables that exist), so a state directory written by
    an older version still opens. Nothing is dropped."""
    inspector = inspect(engine)
    present = {name: {c["name"] for c in inspector.get_columns(name)} for name in inspector.get_table_names()}
    missing = [
        (table.name, column)
        for table in Base.metadata.sorted_tables
        for column in table.columns
        if table.name in present and column.name not in present[table.name]
    ]
    indexes = {name: {i["name"] for i in inspector.get_indexes(name)} for name in present}
    missing_indexes = [
        index
        for table in Base.metadata.sorted_tables
        if table.name in present
        for index in table.indexes
        if index.name not in indexes[table.name]
    ]
    if not missing and not missing_indexes:
        return
    with engine.begin() as connection:
        for table_name, column in missing:
            assert column.nullable or column.server_default is not None, (
                f"{table_name}.{column.name}: an added column must be nullable or have a server default"
            )
            # The column as CREATE TABLE would spell it (type, DEFAULT, NOT NULL): portable DDL.
            definition = CreateColumn(column).compile(dialect=engine.dialect)
            connection.exec_driver_sql(f"ALTER TABLE {table_name} ADD COLUMN {definition}")
        for index in missing_indexes:
            index.create(connection, checkfirst=True)


class Database:
    """An engine plus session factories; `create_all` and additive column migrations run on open."""

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self.url = url
        is_sqlite = make_url(url).get_backend_name() == "sqlite"
        if is_sqlite:
            _prepare_sqlite_file(url)
        connect_args: dict[str, Any] = {"check_same_thread": False} if is_sqlite else {}
        self.engine = create_engine(url, echo=echo, connect_args=connect_args, pool_pre_ping=not is_sqlite)
        if is_sqlite:
            _configure_sqlite(self.engine)
        Base.metadata.create_all(self.engine)
        _add_missing_columns(self.engine)
        self._write_sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_engine = self.engine.execution_options(**{_READ_ONLY: True})
        self._read_sessions = sessionmaker(self._read_engine, expire_on_commit=False)

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception."""
        with self._write_sessions.begin() as session:
            yield session

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction for reads only; it is rolled back at the end."""
        with self._read_sessions() as session:
            try:
                yield session
            finally:
                session.rollback()

    @contextlib.contextmanager
    def write_connection(self) -> Iterator[Connection]:
        """`write` without the ORM: a Core connection in a transaction that commits on success and rolls
        back on any exception. For the statements every request runs (futures.py): a fraction of a
        Session's cost."""
        with self.engine.begin() as connection:
            yield connection

    @contextlib.contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """`read` without the ORM: a Core connection whose transaction is rolled back at the end."""
        with self._read_engine.connect() as connection:
            yield connection

    def close(self) -> None:
        self.engine.dispose()
