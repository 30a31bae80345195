"""`CacheStore.doctor`: find (and optionally repair) disagreements between catalog, blobs and index.

Runs under the store's write lock, so no ingest is half-way while it looks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import select

from cagkv.errors import CorruptBlobError

from .blobs import check_key
from .catalog import Chunk, Document
from .records import DoctorReport, Problem
from .vectors import CorruptIndexError, VectorIndex

if TYPE_CHECKING:
    from .store import CacheStore


def run_doctor(store: CacheStore, repair: bool, verify_blobs: bool) -> DoctorReport:
    report = DoctorReport(ok=True, checked_chunks=0)
    cat = store.catalog
    dim = store.embedding_dim
    canon_fp = store.canonical_fingerprint
    bad_docs: dict[int, str] = {}
    bad_keys: set[str] = set()
    referenced: set[str] = set()

    # 1. every chunk row: a valid key, a blob that exists and parses, the right embedding size
    with cat.read() as s:
        gen = int(cat.get_meta("generation", session=s))
        rows = s.execute(
            select(
                Chunk.id, Chunk.ord, Chunk.text, Chunk.blob_key, Chunk.checksum, Chunk.embedding,
                Chunk.document_id, Document.source,
            ).join(Document, Document.id == Chunk.document_id).order_by(Chunk.id)
        ).all()
    for row in rows:
        report.checked_chunks += 1
        where = f"document {row.source!r} chunk {row.ord} (id {row.id})"
        try:
            check_key(row.blob_key)
        except ValueError:
            msg = f"{where}: invalid blob key {row.blob_key!r}"
            report.problems.append(Problem("bad_row", msg, row.source, row.ord))
            bad_docs[row.document_id] = row.source
            continue
        referenced.add(row.blob_key)
        if len(row.embedding) != 4 * dim:
            report.problems.append(Problem("bad_row", f"{where}: embedding has the wrong size", row.source, row.ord))
            bad_docs[row.document_id] = row.source
        if verify_blobs:
            try:
                store._load_one(row, canon_fp)
            except CorruptBlobError as e:
                kind = "missing_blob" if "is missing" in str(e) else "corrupt_blob"
                report.problems.append(Problem(kind, str(e), row.source, row.ord))
                bad_docs[row.document_id] = row.source
                if kind == "corrupt_blob":
                    bad_keys.add(row.blob_key)
        elif not store.blobs.contains(row.blob_key):
            msg = f"{where}: blob {row.blob_key} is missing"
            report.problems.append(Problem("missing_blob", msg, row.source, row.ord))
            bad_docs[row.document_id] = row.source

    # 2. blobs no row points to (an ingest that died before its commit), temp files
    orphans = [k for k in store.blobs.keys() if k not in referenced]
    for k in orphans:
        report.problems.append(Problem("orphan_blob", f"blob {k} belongs to no chunk"))
    temps = [p for p in store.path.rglob("*.tmp")] if hasattr(store.blobs, "root") else []
    for p in temps:
        report.problems.append(Problem("temp_file", f"temporary file {p} left by an interrupted write"))

    # 3. the persisted index: present, intact, of the current generation, same ids as the catalog
    index_msg = _check_index(store, gen, {r.id for r in rows})
    if index_msg:
        report.problems.append(Problem("index", index_msg))

    report.ok = not report.problems
    if repair and report.problems:
        _repair(store, report, bad_docs, bad_keys, bool(temps))
    return report


def _check_index(store: CacheStore, gen: int, ids: set[int]) -> str | None:
    path = store._index_path()
    try:
        idx = VectorIndex.load(path)
    except CorruptIndexError as e:
        return str(e)
    if idx.store_id != store.store_id:
        return f"vector index {path} belongs to another store ({idx.store_id or 'unknown'})"
    if idx.generation != gen:
        return f"vector index {path} is stale (generation {idx.generation}, catalog {gen})"
    if idx.dim != store.embedding_dim:
        return f"vector index {path} has dim {idx.dim}, catalog {store.embedding_dim}"
    got = set(idx.ids().tolist())
    if got != ids:
        return f"vector index {path} disagrees with the catalog ({len(got ^ ids)} ids differ)"
    return None


def _repair(store: CacheStore, report: DoctorReport, bad_docs: dict[int, str], bad_keys: set[str], temps: bool) -> None:
    cat = store.catalog
    for key in sorted(bad_keys):
        dest = store.blobs.quarantine(key)
        if dest:
            report.repaired.append(f"quarantined blob {key} -> {dest}")
    if bad_docs:
        with cat.write() as s:
            for doc_id, source in sorted(bad_docs.items()):
                store._delete_document_rows(s, doc_id)
                report.repaired.append(f"removed document {source!r} (bad chunks): ingest it again")
            cat.bump_generation(s)
    # orphans, after the removals above (their blobs may now be orphans too)
    with cat.read() as s:
        used = set(s.scalars(select(Chunk.blob_key)).all())
    for key in list(store.blobs.keys()):
        if key not in used:
            store.blobs.remove(key)
            report.repaired.append(f"deleted orphan blob {key}")
    if temps:
        n = store.blobs.clean_temp()
        for p in store.path.glob("*.tmp"):
            p.unlink(missing_ok=True)
            n += 1
        report.repaired.append(f"deleted {n} temporary files")
    # the index, rebuilt from the embeddings in the catalog
    with cat.read() as s:
        gen = int(cat.get_meta("generation", session=s))
        store._index = store._build_index(s, gen)
    store._index.save(store._index_path())
    report.repaired.append(f"rebuilt the vector index from the catalog ({store._index.ntotal} vectors)")
