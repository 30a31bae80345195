"""The SQL catalog (SQLAlchemy 2): documents, chunks, models, translators, meta.

SQLite in WAL mode at `<store>/catalog.db` by default; any SQLAlchemy URL (PostgreSQL
for shared deployments). Readers get a snapshot per `read()` block (SQLite: an explicit
BEGIN; PostgreSQL: REPEATABLE READ), so a search never mixes two committed states.

Tables:
    documents  (id, source, source_hash unique, content_hash, metadata JSON, num_chars, created,
                chunking JSON: the parameters its chunks were made with; NULL before v2)
    chunks     (id never reused, document_id, ord, text, start_char, end_char,
                token_count, blob_key, checksum, nbytes, embedding float32 bytes)
    models     (name, fingerprint, spec JSON)
    translators(id, source_fp, target_fp, path, card JSON, created)
    meta       (key, value JSON): schema_version, store_id (uuid), canonical,
                canonical_fingerprint, tokenizer_hash, embedder, embedding_dim, kv_layout,
                generation (bumped by every write), and settings recorded by callers

Schema versions: 1 (no documents.chunking), 2. Every version up to SCHEMA_VERSION is
read; `Catalog.upgrade` migrates an older catalog (a writer calls it, under the store's
write lock, before it needs the newer schema), so readers never write.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Engine,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
    select,
    text as sql_text,
)
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from cagkv.errors import StoreError

SCHEMA_VERSION = 2


class NoCatalogError(StoreError):
    """The database holds no cagkv catalog (and `create` was not asked)."""


class Base(DeclarativeBase):
    pass


class Document(Base):
    __tablename__ = "documents"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(Text)
    # unique on the hash, not the text: PostgreSQL btree entries are limited to ~2.7 kB
    source_hash: Mapped[str] = mapped_column(String(64), unique=True)
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    num_chars: Mapped[int] = mapped_column(BigInteger, default=0)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # deferred: absent from a version 1 catalog, so only selected once the version says so
    chunking: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True, deferred=True
    )


class Chunk(Base):
    __tablename__ = "chunks"
    # ids are never reused (sqlite_autoincrement): a stale FAISS id can't name a new chunk
    __table_args__ = (UniqueConstraint("document_id", "ord"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id", ondelete="CASCADE"), index=True)
    ord: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    start_char: Mapped[int] = mapped_column(BigInteger)
    end_char: Mapped[int] = mapped_column(BigInteger)
    token_count: Mapped[int] = mapped_column(Integer)
    blob_key: Mapped[str] = mapped_column(String(512), index=True)
    checksum: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    embedding: Mapped[bytes] = mapped_column(LargeBinary)


class Model(Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Translator(Base):
    __tablename__ = "translators"
    __table_args__ = (UniqueConstraint("source_fp", "target_fp", "path"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_fp: Mapped[str] = mapped_column(String(64), index=True)
    target_fp: Mapped[str] = mapped_column(String(64), index=True)
    path: Mapped[str] = mapped_column(String(4096))
    card: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class Meta(Base):
    __tablename__ = "meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[Any] = mapped_column(JSON)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path)}"


def redact(url: str) -> str:
    """A database URL without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


class Catalog:
    """Engine + sessions for one catalog URL; creates the tables when `create` is set."""

    def __init__(self, url: str, create: bool = True) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        try:
            self.engine = _make_engine(url)
        except (ArgumentError, NoSuchModuleError, ValueError) as e:
            raise StoreError(f"invalid database URL {redact(url)!r}: {_short(e)}") from None
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        try:
            with self.engine.connect() as conn:
                has_meta = inspect(conn).has_table("meta")
            if not has_meta and create:
                Base.metadata.create_all(self.engine)
                with self.write() as s:
                    s.add(Meta(key="schema_version", value=SCHEMA_VERSION))
                    s.add(Meta(key="generation", value=0))
                    s.add(Meta(key="store_id", value=uuid.uuid4().hex))
            elif not has_meta:
                raise NoCatalogError(f"no cagkv catalog at {redact(url)}")
            version = self.get_meta("schema_version")
            if version is None and not create:
                # tables committed, meta rows not yet: another process is creating this catalog
                # (it holds the store's write lock; CacheStore.open waits on it and opens again)
                raise NoCatalogError(f"the cagkv catalog at {redact(url)} is still being created")
        except OperationalError as e:
            self.engine.dispose()
            raise StoreError(f"cannot open catalog {redact(url)}: {_short(e)}") from None
        except BaseException:
            self.engine.dispose()
            raise
        if version not in range(1, SCHEMA_VERSION + 1):
            raise StoreError(
                f"catalog {redact(url)} has schema version {version!r}; "
                f"this cagkv reads versions 1 to {SCHEMA_VERSION}"
            )

    # ------------------------------------------------------------ sessions
    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only snapshot: every query inside sees one committed state."""
        with self._session() as s:
            if not self.is_sqlite:
                s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            try:
                yield s
            finally:
                s.rollback()

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction: committed on success, rolled back on any error."""
        with self._session() as s, s.begin():
            yield s

    # ------------------------------------------------------------ meta
    def get_meta(self, key: str, default: Any = None, session: Session | None = None) -> Any:
        if session is not None:
            row = session.get(Meta, key)
            return default if row is None else row.value
        with self.read() as s:
            return self.get_meta(key, default, s)

    @staticmethod
    def set_meta(session: Session, key: str, value: Any) -> None:
        row = session.get(Meta, key)
        if row is None:
            session.add(Meta(key=key, value=value))
        else:
            row.value = value

    def version(self, session: Session | None = None) -> int:
        """The schema version as committed (another process may have upgraded it)."""
        return int(self.get_meta("schema_version", session=session))

    def upgrade(self) -> None:
        """Migrate an older catalog to SCHEMA_VERSION in one transaction (a no-op when current).

        Callers hold the store's write lock; the locked version row also serialises two
        upgraders sharing one database.
        """
        with self.write() as s:
            row = s.execute(select(Meta).where(Meta.key == "schema_version").with_for_update()).scalar_one()
            for version in range(int(row.value), SCHEMA_VERSION):
                for statement in _MIGRATIONS[version]:
                    s.execute(sql_text(statement))
                row.value = version + 1

    @staticmethod
    def bump_generation(session: Session) -> int:
        """Increment the write generation inside the caller's transaction; return the new value."""
        row = session.execute(select(Meta).where(Meta.key == "generation").with_for_update()).scalar_one()
        row.value = int(row.value) + 1
        return row.value

    def close(self) -> None:
        self.engine.dispose()


# version -> the statements that migrate a catalog of that version to the next one
_MIGRATIONS: dict[int, list[str]] = {
    1: ["ALTER TABLE documents ADD COLUMN chunking JSON"],
}


def _make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (snapshot reads)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


def _short(e: BaseException) -> str:
    msg = str(getattr(e, "orig", None) or e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


__all__ = [
    "SCHEMA_VERSION",
    "Catalog",
    "Chunk",
    "Document",
    "Meta",
    "NoCatalogError",
    "Model",
    "SQLAlchemyError",
    "Translator",
    "now",
    "redact",
    "sqlite_url",
]
