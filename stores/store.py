"""CacheStore: the facade that keeps catalog, blobs and the FAISS index consistent.

Layout of a store folder:
    catalog.db             SQLite catalog (WAL) unless a `db_url` points elsewhere
    blobs/xx/<sha256>.kv   one safetensors KV block per chunk, content-addressed
    vectors.safetensors    the persisted FAISS index (+ the catalog generation it reflects)
    write.lock             inter-process writer lock (fcntl); readers never take it

Write order (one document at a time, `add_document`): blobs (atomic files) -> one
catalog transaction (rows + generation bump) -> index update -> removal of blobs no
longer referenced. A crash at any point leaves a store that opens and never shows a
chunk whose blob is missing: uncommitted blobs are orphans (`doctor --repair` collects
them), a stale index is detected by its generation and rebuilt from the embeddings the
catalog keeps.

Readers take no lock: each search runs in one catalog snapshot with an index of that
snapshot's generation (rebuilt in memory when the file lags), and `retrieve` retries
when a writer removed a chunk between search and load.

Example:
    >>> store = CacheStore.open("~/.cache/cagkv/store", canonical="smollm2-135m", fingerprint=fp)
    >>> store.add_document("a.txt", text, {"title": "A"}, [(chunk, block), ...])
    >>> hits = store.search("who wrote it?", k=3)
    >>> blocks = store.load_blocks([h.chunk_id for h in hits])
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, undefer

from cagkv.errors import CorruptBlobError, StoreError, UsageError
from cagkv.kv import KVBlock

from .blobs import BlobStore, check_key, open_blob_store
from .catalog import Catalog, Chunk, Document, Model, NoCatalogError, Translator, now, redact, source_hash, sqlite_url
from .checks import MAX_SOURCE_CHARS, MAX_TEXT_CHARS, as_ids, check_json, check_layout, check_text, doc_cond
from .durability import fault, file_lock
from .embed import DEFAULT_EMBEDDER, Embedder, make_embedder, normalise
from .records import (
    AddResult, ChunksChangedError, DocumentInfo, DoctorReport, Hit, Problem, TextChunkLike, blob_key,
    content_hash, normal_json,
)  # fmt: skip
from .vectors import CorruptIndexError, VectorIndex

INDEX_FILE = "vectors.safetensors"
LOCK_FILE = "write.lock"


_MANAGED_META = (
    "schema_version", "store_id", "generation", "canonical", "canonical_fingerprint",
    "tokenizer_hash", "embedder", "embedding_dim", "kv_layout",
)  # fmt: skip

__all__ = [  # the records are re-exported: `from cagkv.stores.store import Hit` keeps working
    "AddResult", "CacheStore", "ChunksChangedError", "DocumentInfo", "DoctorReport", "Hit", "Problem",
    "blob_key", "content_hash",
]  # fmt: skip


class CacheStore:
    """Catalog + blobs + FAISS index of one store. Open with `CacheStore.open`."""

    def __init__(
        self,
        path: Path,
        catalog: Catalog,
        blobs: BlobStore,
        embedder: Embedder | None,
        quantize: str | None,
        lock_timeout: float,
    ) -> None:
        self.path = path
        self.catalog = catalog
        self.blobs = blobs
        self.quantize = quantize
        self.lock_timeout = lock_timeout
        self._embedder = embedder
        self._index: VectorIndex | None = None
        self._lock_depth = 0
        self._lock_cm: Any = None
        self._thread_lock = threading.RLock()  # writers of this handle, one thread at a time
        self._index_lock = threading.RLock()  # the in-memory FAISS index
        self._defer_index_save = 0
        self._meta_cache: dict[str, Any] = {}
        self._schema_current = False

    # ================================================================ opening
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        db_url: str | None = None,
        canonical: str | None = None,
        *,
        fingerprint: str | None = None,
        tokenizer_hash: str | None = None,
        embedder: str | Embedder | None = None,
        blob_url: str | None = None,
        create: bool = True,
        quantize: str | None = None,
        lock_timeout: float = 120.0,
    ) -> CacheStore:
        """Open (or create) the store at `path`.

        Args:
            path: the store folder (blobs, index, lock and, by default, the SQLite catalog).
            db_url: a SQLAlchemy URL for the catalog (default `sqlite:///<path>/catalog.db`).
            canonical, fingerprint: the canonical model; recorded on first use, and a
                store made with another canonical model (or fingerprint) is refused.
            tokenizer_hash: the canonical tokenizer's `cagkv.models.tokenizer_hash`; recorded
                when the store has none (also a store made before it was recorded), and
                another one is refused.
            embedder: an embedder name (`minilm-l6`, `hash-64`) or object; recorded at creation.
            blob_url: an fsspec URL for the blobs (default `<path>/blobs`).
            create: create a missing store (else StoreError).
            quantize: None or "int8" for blocks written by this handle.
        """
        if quantize not in (None, "int8"):
            raise UsageError(f"quantize must be one of None, 'int8'; got {quantize!r}")
        root = Path(path).expanduser()
        if not root.is_dir():
            if not create:
                raise StoreError(f"no cagkv store at {root}")
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create store {root}: {e.strerror or e}") from None
        if create and not os.access(root, os.W_OK):
            raise StoreError(f"store {root} is not writable")
        if db_url is None and not create and not (root / "catalog.db").exists():
            raise StoreError(f"no cagkv store at {root} (no catalog.db)")
        url = db_url or sqlite_url(root / "catalog.db")
        try:
            catalog = Catalog(url, create=False)  # readers of an existing store take no lock
        except NoCatalogError:
            if not create:
                raise
            with file_lock(root / LOCK_FILE, lock_timeout):  # two creators: one creates, one opens
                catalog = Catalog(url, create=True)
        try:
            blobs = open_blob_store(blob_url or root / "blobs")
            store = cls(root, catalog, blobs, None, quantize, lock_timeout)
            store._check_identity(canonical, fingerprint, embedder, tokenizer_hash)
        except BaseException:
            catalog.close()
            raise
        return store

    def _check_identity(
        self,
        canonical: str | None,
        fingerprint: str | None,
        embedder: str | Embedder | None,
        tokenizer: str | None = None,
    ) -> None:
        emb_name = embedder if isinstance(embedder, str) else getattr(embedder, "name", None)
        keys = ("canonical", "canonical_fingerprint", "tokenizer_hash", "embedder")
        with self.catalog.read() as s:
            meta = {k: self.catalog.get_meta(k, session=s) for k in keys}
        if canonical is not None and meta["canonical"] not in (None, canonical):
            raise StoreError(
                f"store {self.path} was made with canonical model {meta['canonical']!r}, not {canonical!r}"
            )
        if fingerprint is not None and meta["canonical_fingerprint"] not in (None, fingerprint):
            raise StoreError(
                f"store {self.path} was made with canonical fingerprint {meta['canonical_fingerprint']}, "
                f"not {fingerprint}: the model changed since ingest"
            )
        if tokenizer is not None and meta["tokenizer_hash"] not in (None, tokenizer):
            raise StoreError(self._tokenizer_mismatch(meta["tokenizer_hash"], tokenizer))
        if emb_name is not None and meta["embedder"] not in (None, emb_name):
            raise StoreError(f"store {self.path} uses embedder {meta['embedder']!r}, not {emb_name!r}")
        if embedder is not None and not isinstance(embedder, str):
            self._embedder = embedder
        updates: dict[str, Any] = {}
        if meta["canonical"] is None and canonical is not None:
            updates["canonical"] = canonical
        if meta["canonical_fingerprint"] is None and fingerprint is not None:
            updates["canonical_fingerprint"] = fingerprint
        if meta["tokenizer_hash"] is None and tokenizer is not None:
            updates["tokenizer_hash"] = tokenizer
        if meta["embedder"] is None:
            emb = self._embedder or make_embedder(emb_name or DEFAULT_EMBEDDER)
            self._embedder = emb
            updates["embedder"] = emb.name
            updates["embedding_dim"] = int(emb.dim)
        if updates:
            with self._write_lock(), self.catalog.write() as s:
                for k, v in updates.items():
                    if self.catalog.get_meta(k, session=s) is None:
                        self.catalog.set_meta(s, k, v)

    def check_tokenizer(self, tokenizer_hash: str, record: bool = False) -> None:
        """Refuse a canonical tokenizer other than the one recorded (StoreError naming both).

        A store with none recorded passes; with `record` (writers: ingest) it is recorded.
        """
        recorded = self.catalog.get_meta("tokenizer_hash")
        if recorded not in (None, tokenizer_hash):
            raise StoreError(self._tokenizer_mismatch(recorded, tokenizer_hash))
        if recorded is None and record:
            self._check_identity(None, None, None, tokenizer_hash)

    def _tokenizer_mismatch(self, recorded: str, given: str) -> str:
        return (
            f"store {self.path} was made with canonical tokenizer {recorded}, not {given}: "
            "the tokenizer changed since ingest; re-ingest into a new store"
        )

    # ================================================================ properties
    def _fixed_meta(self, key: str) -> Any:
        """Meta values that never change once set (cached per handle)."""
        if key not in self._meta_cache:
            value = self.catalog.get_meta(key)
            if value is None:
                return None
            self._meta_cache[key] = value
        return self._meta_cache[key]

    @property
    def store_id(self) -> str:
        return str(self._fixed_meta("store_id") or "")

    @property
    def canonical(self) -> str | None:
        return self._fixed_meta("canonical")

    @property
    def canonical_fingerprint(self) -> str | None:
        return self._fixed_meta("canonical_fingerprint")

    @property
    def tokenizer_hash(self) -> str | None:
        return self._fixed_meta("tokenizer_hash")

    @property
    def embedding_dim(self) -> int:
        return int(self._fixed_meta("embedding_dim"))

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = make_embedder(self.catalog.get_meta("embedder") or DEFAULT_EMBEDDER)
        return self._embedder

    def set_meta(self, key: str, value: Any) -> None:
        """Record a store-wide setting (e.g. `chunking`); JSON-serialisable values only."""
        if key in _MANAGED_META:
            raise UsageError(f"meta key {key!r} is managed by the store")
        check_json(value, "meta value")
        with self._write_lock(), self.catalog.write() as s:
            self.catalog.set_meta(s, key, value)

    def get_meta(self, key: str, default: Any = None) -> Any:
        return self.catalog.get_meta(key, default)

    # ================================================================ locking
    @contextmanager
    def _write_lock(self) -> Iterator[None]:
        """Exclusive inter-process writer lock (fcntl on `write.lock`); re-entrant in-process."""
        with self._thread_lock:
            if self._lock_depth == 0:
                self._lock_cm = file_lock(self.path / LOCK_FILE, self.lock_timeout)
                self._lock_cm.__enter__()
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
                if self._lock_depth == 0:
                    self._lock_cm.__exit__(None, None, None)

    @contextmanager
    def batch(self) -> Iterator[CacheStore]:
        """Hold the write lock across several writes and save the index once at the end."""
        with self._write_lock():
            self._defer_index_save += 1
            try:
                yield self
            finally:
                self._defer_index_save -= 1
                if self._defer_index_save == 0:
                    self._writer_index()  # saves the index when the file lags the catalog

    # ================================================================ index
    def _index_path(self) -> Path:
        return self.path / INDEX_FILE

    def _index_for(self, s: Session, generation: int) -> VectorIndex:
        """An index that reflects exactly the catalog snapshot `s` at `generation`.

        The persisted file is used when it carries this store's id and this generation
        (and its checksum and size agree); otherwise the index is rebuilt in memory from
        the embeddings of the snapshot (readers never write it).
        """
        if self._index is not None and self._index.generation == generation:
            return self._index
        stamp = (self.store_id, generation)
        if VectorIndex.read_stamp(self._index_path()) == stamp:
            try:
                idx = VectorIndex.load(self._index_path())
                n = s.scalar(select(func.count(Chunk.id))) or 0
                if (idx.store_id, idx.generation) == stamp and idx.ntotal == n and idx.dim == self.embedding_dim:
                    self._index = idx
                    return idx
            except CorruptIndexError:
                pass
        self._index = self._build_index(s, generation)
        return self._index

    def _build_index(self, s: Session, generation: int) -> VectorIndex:
        dim = self.embedding_dim
        ids, vecs = [], []
        for cid, emb in s.execute(select(Chunk.id, Chunk.embedding).order_by(Chunk.id)):
            v = np.frombuffer(emb, dtype=np.float32)
            if v.shape != (dim,):
                raise StoreError(f"chunk {cid} has an embedding of {v.size} values, expected {dim}")
            ids.append(cid)
            vecs.append(v)
        mat = np.stack(vecs) if vecs else np.zeros((0, dim), np.float32)  # [N, dim]
        return VectorIndex.build(dim, np.asarray(ids, np.int64), mat, generation, self.store_id)

    def _writer_index(self) -> VectorIndex:
        """Under the write lock: the index of the latest committed state (rebuilt + saved if stale)."""
        with self.catalog.read() as s:
            gen = int(self.catalog.get_meta("generation", session=s))
            with self._index_lock:
                idx = self._index_for(s, gen)
        if VectorIndex.read_stamp(self._index_path()) != (self.store_id, gen) and not self._defer_index_save:
            self._save_index(idx)
        return idx

    def _save_index(self, idx: VectorIndex) -> None:
        fault("before_index_save")
        with self._index_lock:
            idx.save(self._index_path())
        fault("after_index_save")

    # ================================================================ writing
    def has_document(self, source: str, text: str, chunking: dict[str, Any] | None = None) -> bool:
        """True when `source` is stored with exactly this text and chunking (ingest would be skipped)."""
        with self.catalog.read() as s:
            old = self._stored_key(s, source)
        return old is not None and old[1:] == (content_hash(text), normal_json(chunking))

    def _stored_key(self, s: Session, source: str) -> tuple[int, str, dict[str, Any] | None] | None:
        """(id, content hash, chunking) of `source` in snapshot `s`; chunking is None before schema v2."""
        cols = [Document.id, Document.content_hash]
        if self.catalog.version(s) >= 2:
            cols.append(Document.chunking)
        row = s.execute(select(*cols).where(Document.source_hash == source_hash(source))).first()
        if row is None:
            return None
        return int(row[0]), row[1], row[2] if len(row) > 2 else None

    def add_document(
        self,
        source: str,
        text: str,
        metadata: dict[str, Any] | None,
        chunks: Iterable[tuple[TextChunkLike, KVBlock]],
        embeddings: np.ndarray | None = None,
        chunking: dict[str, Any] | None = None,
    ) -> AddResult:
        """Store one document's chunks atomically; idempotent by (source, content hash, chunking).

        Args:
            source: the document's identity (path or URI); a new text for a known source
                replaces its chunks in one transaction.
            text: the full document text (hashed; chunks point into it by char offsets).
            metadata: JSON-serialisable, at most 256 KiB.
            chunks: `(TextChunk(text, start, end), KVBlock)` pairs in document order; may be
                a generator (each block is serialised and released before the next).
            embeddings: `[N, dim]` chunk embeddings; computed with the store's embedder
                from the chunk texts when None.
            chunking: JSON-serialisable parameters the chunks were made with (recorded with
                the document); the same text with other parameters replaces its chunks.
        """
        check_text(source, "source", MAX_SOURCE_CHARS)
        if not source.strip():
            raise UsageError("document source must not be empty")
        check_text(text, "document text", MAX_TEXT_CHARS)
        metadata = dict(metadata or {})
        check_json(metadata, "document metadata")
        check_json(chunking, "chunking parameters")
        chunking = normal_json(chunking)
        chash = content_hash(text)
        with self._write_lock():
            self._upgrade_schema()
            with self.catalog.read() as s:
                old = self._stored_key(s, source)
            if old is not None and old[1:] == (chash, chunking):
                return AddResult(old[0], "unchanged")
            canon_fp = self.canonical_fingerprint
            layout = self._fixed_meta("kv_layout")
            rows: list[dict[str, Any]] = []
            texts: list[str] = []
            created: list[str] = []  # blobs this call made: removed again if it fails before the commit
            try:
                fault("before_blobs")
                for i, (chunk, block) in enumerate(chunks):
                    layout = check_layout(i, block, layout)
                    row, new_blob = self._put_chunk(i, chunk, block, text, canon_fp)
                    rows.append(row)
                    if new_blob:
                        created.append(row["blob_key"])
                    canon_fp = canon_fp or block.model_fingerprint
                    texts.append(chunk.text)
                    if i == 0:
                        fault("mid_blobs")
                fault("after_blobs")
                vecs = self._chunk_embeddings(texts, embeddings)
                idx = self._writer_index()
                with self.catalog.write() as s:
                    old_ids, old_keys = self._delete_document_rows(s, source)
                    if self.catalog.get_meta("canonical_fingerprint", session=s) is None and canon_fp:
                        self.catalog.set_meta(s, "canonical_fingerprint", canon_fp)
                    if self.catalog.get_meta("kv_layout", session=s) is None and layout:
                        self.catalog.set_meta(s, "kv_layout", layout)
                    doc = Document(
                        source=source, source_hash=source_hash(source), content_hash=chash,
                        meta=metadata, num_chars=len(text), created=now(), chunking=chunking,
                    )  # fmt: skip
                    s.add(doc)
                    s.flush()
                    chunk_rows = [
                        Chunk(document_id=doc.id, embedding=v.tobytes(), **r) for r, v in zip(rows, vecs, strict=True)
                    ]
                    s.add_all(chunk_rows)
                    s.flush()
                    new_ids = [c.id for c in chunk_rows]
                    gen = self.catalog.bump_generation(s)
                    doc_id = int(doc.id)
                    fault("before_commit")
            except BaseException:
                self._collect_blobs(created, None)
                raise
            fault("after_commit")
            with self._index_lock:
                idx.remove(old_ids)
                idx.add(np.asarray(new_ids, np.int64), vecs)
                idx.generation = gen
            if not self._defer_index_save:
                self._save_index(idx)
            self._collect_blobs(old_keys - {r["blob_key"] for r in rows}, "mid_old_blob_delete")
        status = "replaced" if old is not None else "added"
        return AddResult(doc_id, status, len(rows), sum(r["token_count"] for r in rows), sum(r["nbytes"] for r in rows))

    def _upgrade_schema(self) -> None:
        """Under the write lock: migrate an older catalog once per handle (readers never do)."""
        if not self._schema_current:
            self.catalog.upgrade()
            self._schema_current = True

    def _put_chunk(
        self, i: int, chunk: TextChunkLike, block: KVBlock, text: str, canon_fp: str | None
    ) -> tuple[dict[str, Any], bool]:
        """Serialise and write one block; return its chunk row and whether the blob is new."""
        if not isinstance(block, KVBlock):
            raise UsageError(f"chunk {i}: expected a KVBlock, got {type(block).__name__}")
        if canon_fp is not None and block.model_fingerprint != canon_fp:
            raise StoreError(
                f"chunk {i}: block made by model {block.model_fingerprint}, the store's canonical model is {canon_fp}"
            )
        start, end = int(chunk.start), int(chunk.end)
        if not (0 <= start <= end <= len(text)) or text[start:end] != chunk.text:
            raise UsageError(f"chunk {i}: span {start}:{end} does not match the chunk text in the document")
        if block.text != chunk.text:
            raise UsageError(f"chunk {i}: the KV block's text differs from the chunk text")
        data = block.to_bytes(quantize=self.quantize)
        key = blob_key(data)
        existed = self.blobs.contains(key)
        checksum = self.blobs.put(key, data)  # content-addressed: rewriting identical bytes is harmless
        row = {
            "ord": i,
            "text": chunk.text,
            "start_char": start,
            "end_char": end,
            "token_count": block.num_tokens,
            "blob_key": key,
            "checksum": checksum,
            "nbytes": len(data),
        }
        return row, not existed

    def _chunk_embeddings(self, texts: list[str], embeddings: np.ndarray | None) -> np.ndarray:
        dim = self.embedding_dim
        if embeddings is None:
            vecs = self.embedder.embed(texts) if texts else np.zeros((0, dim), np.float32)
        else:
            vecs = np.asarray(embeddings, dtype=np.float32)
        if vecs.shape != (len(texts), dim):
            raise UsageError(f"embeddings must be [{len(texts)}, {dim}], got {list(vecs.shape)}")
        if not np.isfinite(vecs).all():
            raise UsageError("embeddings hold NaN or Inf")
        return np.ascontiguousarray(normalise(vecs))

    def _delete_document_rows(self, s: Session, source: str | int) -> tuple[list[int], set[str]]:
        """Delete a document and its chunks inside `s`; return (chunk ids, blob keys)."""
        cond = doc_cond(source)
        doc_id = s.scalar(select(Document.id).where(cond))
        if doc_id is None:
            return [], set()
        old = s.execute(select(Chunk.id, Chunk.blob_key).where(Chunk.document_id == doc_id)).all()
        s.execute(delete(Chunk).where(Chunk.document_id == doc_id))
        s.execute(delete(Document).where(Document.id == doc_id))
        return [r.id for r in old], {r.blob_key for r in old}

    def _collect_blobs(self, keys: Iterable[str], fault_point: str | None) -> None:
        """Remove blobs that no committed chunk references any more (shared blobs are kept)."""
        for n, key in enumerate(sorted(keys)):
            with self.catalog.read() as s:
                used = s.scalar(select(func.count(Chunk.id)).where(Chunk.blob_key == key))
            if not used:
                self.blobs.remove(key)
            if n == 0 and fault_point:
                fault(fault_point)

    def remove(self, document: int | str, missing_ok: bool = False) -> int:
        """Remove a document (by id or source) with its chunks, vectors and blobs; return chunks removed.

        An unknown document raises UsageError, or returns 0 with `missing_ok`.
        """
        with self._write_lock():
            idx = self._writer_index()
            with self.catalog.write() as s:
                exists = s.scalar(select(Document.id).where(doc_cond(document)))
                if exists is None:
                    if missing_ok:
                        return 0
                    raise UsageError(f"no document {document!r} in store {self.path}")
                ids, keys = self._delete_document_rows(s, document)
                gen = self.catalog.bump_generation(s)
            fault("remove_after_commit")
            with self._index_lock:
                idx.remove(ids)
                idx.generation = gen
            if not self._defer_index_save:
                self._save_index(idx)
            fault("remove_before_blob_delete")
            self._collect_blobs(keys, "mid_old_blob_delete")
        return len(ids)

    # ================================================================ reading
    def search(
        self, question: str | np.ndarray, k: int = 3, document_ids: Sequence[int] | None = None
    ) -> list[Hit]:
        """Top-k chunks for a question (text or a `[dim]` embedding), best first, in one snapshot."""
        if isinstance(question, str):
            if not question.strip():
                raise UsageError("the question is empty")
            q = self.embedder.embed([question])[0]
        else:
            q = normalise(np.asarray(question, dtype=np.float32).reshape(-1))
            if q.shape != (self.embedding_dim,) or not np.isfinite(q).all():
                raise UsageError(f"question embedding must be [{self.embedding_dim}] finite values")
        if k <= 0:
            return []
        doc_ids = None if document_ids is None else as_ids(document_ids)
        with self.catalog.read() as s:
            gen = int(self.catalog.get_meta("generation", session=s))
            allowed = None
            if doc_ids is not None:
                allowed = s.scalars(select(Chunk.id).where(Chunk.document_id.in_(doc_ids))).all()
            with self._index_lock:  # FAISS objects are not safe to search while another thread edits them
                found = self._index_for(s, gen).search(q, k, allowed)
            if not found:
                return []
            rows = {
                r.id: r
                for r in s.execute(
                    select(Chunk.id, Chunk.document_id, Chunk.text, Chunk.ord, Document.source)
                    .join(Document, Document.id == Chunk.document_id)
                    .where(Chunk.id.in_([cid for cid, _ in found]))
                )
            }
        return [
            Hit(cid, rows[cid].document_id, score, rows[cid].text, rows[cid].source, rows[cid].ord)
            for cid, score in found
            if cid in rows
        ]

    def load_blocks(self, chunk_ids: Sequence[int]) -> list[KVBlock]:
        """The KV blocks of `chunk_ids`, in that order; every blob checked against its checksum."""
        ids = as_ids(chunk_ids)
        with self.catalog.read() as s:
            rows = {
                r.id: r
                for r in s.execute(
                    select(Chunk.id, Chunk.ord, Chunk.text, Chunk.blob_key, Chunk.checksum, Document.source)
                    .join(Document, Document.id == Chunk.document_id)
                    .where(Chunk.id.in_(ids))
                )
            }
        missing = [c for c in ids if c not in rows]
        if missing:
            raise ChunksChangedError(f"chunks {missing[:5]} are not in store {self.path} (removed?)")
        canon_fp = self.canonical_fingerprint
        return [self._load_one(rows[c], canon_fp) for c in ids]

    def _load_one(self, row: Any, canon_fp: str | None) -> KVBlock:
        where = f"document {row.source!r} chunk {row.ord} (id {row.id})"
        try:
            data = self.blobs.get(check_key(row.blob_key), expected_sha=row.checksum)
        except ValueError:
            raise CorruptBlobError(f"{where}: invalid blob key {row.blob_key!r}") from None
        except CorruptBlobError as e:
            raise CorruptBlobError(f"{where}: {e}") from None
        if data is None:
            with self.catalog.read() as s:
                still = s.get(Chunk, row.id) is not None
            if not still:
                raise ChunksChangedError(f"{where} was removed while reading")
            raise CorruptBlobError(f"{where}: blob {row.blob_key} is missing (run `cagkv doctor --repair`)")
        try:
            block = KVBlock.from_bytes(data)
        except CorruptBlobError as e:
            raise CorruptBlobError(f"{where}: {e}") from None
        if canon_fp is not None and block.model_fingerprint != canon_fp:
            raise CorruptBlobError(f"{where}: block made by model {block.model_fingerprint}, store's is {canon_fp}")
        if block.text != row.text:
            raise CorruptBlobError(f"{where}: block text differs from the catalog's chunk text")
        return block

    def retrieve(
        self, question: str | np.ndarray, k: int = 3, document_ids: Sequence[int] | None = None, retries: int = 5
    ) -> list[tuple[Hit, KVBlock]]:
        """`search` + `load_blocks` that retries when a concurrent writer removed a hit."""
        for attempt in range(retries + 1):
            hits = self.search(question, k, document_ids)
            try:
                return list(zip(hits, self.load_blocks([h.chunk_id for h in hits]), strict=True))
            except ChunksChangedError:
                if attempt == retries:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    def get_document(self, document: int | str) -> DocumentInfo:
        cond = doc_cond(document)
        docs = self._documents(cond)
        if not docs:
            raise UsageError(f"no document {document!r} in store {self.path}")
        return docs[0]

    def list_documents(self) -> list[DocumentInfo]:
        return self._documents(None)

    def _documents(self, cond: Any) -> list[DocumentInfo]:
        q = (
            select(
                Document,
                func.count(Chunk.id),
                func.coalesce(func.sum(Chunk.token_count), 0),
                func.coalesce(func.sum(Chunk.nbytes), 0),
            )
            .outerjoin(Chunk, Chunk.document_id == Document.id)
            .group_by(Document.id)
            .order_by(Document.id)
        )
        if cond is not None:
            q = q.where(cond)
        with self.catalog.read() as s:
            v2 = self.catalog.version(s) >= 2
            if v2:
                q = q.options(undefer(Document.chunking))
            return [
                DocumentInfo(
                    d.id, d.source, d.content_hash, dict(d.meta or {}), int(n), int(t), int(b), d.created.isoformat(),
                    d.chunking if v2 else None,
                )
                for d, n, t, b in s.execute(q)
            ]

    def chunks_of(self, document: int | str) -> list[Hit]:
        """Every chunk of a document in order (score 0): what `native` mode prefills."""
        doc = self.get_document(document)
        with self.catalog.read() as s:
            rows = s.execute(
                select(Chunk.id, Chunk.text, Chunk.ord).where(Chunk.document_id == doc.id).order_by(Chunk.ord)
            ).all()
        return [Hit(r.id, doc.id, 0.0, r.text, doc.source, r.ord) for r in rows]

    def stats(self) -> dict[str, Any]:
        with self.catalog.read() as s:
            docs = s.scalar(select(func.count(Document.id))) or 0
            n, tokens, nbytes = s.execute(
                select(
                    func.count(Chunk.id),
                    func.coalesce(func.sum(Chunk.token_count), 0),
                    func.coalesce(func.sum(Chunk.nbytes), 0),
                )
            ).one()
            keys = ("canonical", "canonical_fingerprint", "tokenizer_hash", "embedder", "embedding_dim",
                    "generation", "schema_version", "store_id", "kv_layout", "chunking")  # fmt: skip
            meta = {k: self.catalog.get_meta(k, session=s) for k in keys}
        return {
            "path": str(self.path),
            "catalog": redact(self.catalog.url),
            "blobs": self.blobs.url,
            "documents": int(docs),
            "chunks": int(n),
            "tokens": int(tokens),
            "bytes": int(nbytes),
            **meta,
        }

    # ================================================================ translators (next issue)
    def register_model(self, name: str, fingerprint: str, spec: dict[str, Any] | None = None) -> None:
        check_json(spec or {}, "model spec")
        with self._write_lock(), self.catalog.write() as s:
            row = s.get(Model, name)
            if row is None:
                s.add(Model(name=name, fingerprint=fingerprint, spec=spec or {}))
            else:
                row.fingerprint, row.spec = fingerprint, spec or {}

    def add_translator(self, source_fp: str, target_fp: str, path: str, card: dict[str, Any]) -> int:
        check_json(card, "translator card")
        with self._write_lock(), self.catalog.write() as s:
            row = s.scalar(
                select(Translator).where(
                    Translator.source_fp == source_fp, Translator.target_fp == target_fp, Translator.path == path
                )
            )
            if row is None:
                row = Translator(source_fp=source_fp, target_fp=target_fp, path=path, card=card, created=now())
                s.add(row)
            else:
                row.card = card
            s.flush()
            return int(row.id)

    def translators(self, source_fp: str, target_fp: str) -> list[dict[str, Any]]:
        """Registered translators for exactly this model pair, newest first."""
        with self.catalog.read() as s:
            rows = s.scalars(
                select(Translator)
                .where(Translator.source_fp == source_fp, Translator.target_fp == target_fp)
                .order_by(Translator.id.desc())
            ).all()
            return [{"id": r.id, "path": r.path, "card": r.card, "created": r.created.isoformat()} for r in rows]

    # ================================================================ doctor
    def doctor(self, repair: bool = False, verify_blobs: bool = True) -> DoctorReport:
        """Check catalog, blobs and index agree; with `repair`, fix what was found.

        Finds: chunks whose blob is missing, corrupt (checksum, format, NaN/Inf, wrong
        model or text), orphan blobs, temporary files, an index that is missing, corrupt
        or stale. Repair quarantines bad blobs and removes the affected documents (their
        rows; re-ingest restores them), deletes orphans and temp files, and rebuilds the index.
        """
        from .doctor import run_doctor

        with self._write_lock():
            return run_doctor(self, repair, verify_blobs)

    # ================================================================ closing
    def close(self) -> None:
        self.blobs.close()
        self.catalog.close()

    def __enter__(self) -> CacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
