"""CacheStore and its parts (catalog, blobs, vectors, embedders) on temporary stores.

No models: KV blocks are random tensors seeded by the chunk text, embeddings come from
the deterministic HashEmbedder. The same suite runs against PostgreSQL in
tests/reliability/test_postgres.py.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from cagkv.stores import CacheStore, ChunksChangedError, HashEmbedder, VectorIndex, open_blob_store
from cagkv.stores.blobs import LocalBlobStore, check_key
from cagkv.stores.records import blob_key

from cagkv.errors import CorruptBlobError, StoreError, UsageError
from cagkv.kv import KVBlock

FP = "fp-canonical-0001"


@dataclass
class TextChunk:
    text: str
    start: int
    end: int


def make_block(text: str, fp: str = FP, layers: int = 2, heads: int = 1, dim: int = 8) -> KVBlock:
    words = list(re.finditer(r"\S+", text))
    t = len(words)
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    return KVBlock(
        keys=torch.randn(layers, heads, t, dim, generator=g),
        values=torch.randn(layers, heads, t, dim, generator=g),
        token_ids=torch.arange(t, dtype=torch.int64),
        offsets=torch.tensor([[m.start(), m.end()] for m in words], dtype=torch.int64).reshape(t, 2),
        text=text,
        model_fingerprint=fp,
    )


def chunked(text: str, per: int = 2, fp: str = FP) -> list[tuple[TextChunk, KVBlock]]:
    """Split on sentences, `per` sentences a chunk."""
    spans = [m.span() for m in re.finditer(r"[^.!?]+[.!?]?", text) if m.group().strip()]
    out = []
    for i in range(0, len(spans), per):
        s, e = spans[i][0], spans[min(i + per, len(spans)) - 1][1]
        out.append((TextChunk(text[s:e], s, e), make_block(text[s:e], fp)))
    return out


DOCS = {
    "paris.txt": "Paris is the capital of France. The Eiffel tower stands in Paris. "
    "The Seine flows through the city. Many museums line its banks.",
    "rome.txt": "Rome is the capital of Italy. The Colosseum is in Rome. The Tiber river crosses Rome.",
    "tokyo.txt": "Tokyo is the capital of Japan. Mount Fuji is visible on clear days.",
}


def open_store(path: Path, **kw) -> CacheStore:
    kw.setdefault("canonical", "tiny")
    kw.setdefault("fingerprint", FP)
    kw.setdefault("embedder", HashEmbedder(64))
    return CacheStore.open(path, **kw)


def ingest(store: CacheStore, docs: dict[str, str] = DOCS, per: int = 2) -> dict[str, int]:
    return {src: store.add_document(src, text, {"lang": "en"}, chunked(text, per)).document_id
            for src, text in docs.items()}  # fmt: skip


@pytest.fixture
def store(tmp_path: Path, request) -> CacheStore:
    db_url = getattr(request, "param", None)
    s = open_store(tmp_path / "store", db_url=db_url)
    yield s
    s.close()


# ------------------------------------------------------------------ KV round trip through the store
def test_add_search_load_round_trip(store: CacheStore):
    ids = ingest(store)
    hits = store.search("Which river flows through Rome?", k=2)
    assert hits and hits[0].source == "rome.txt" and "Tiber" in hits[0].text
    assert hits[0].score >= hits[-1].score
    blocks = store.load_blocks([h.chunk_id for h in hits])
    for h, b in zip(hits, blocks, strict=True):
        ref = make_block(h.text)
        assert torch.equal(b.keys, ref.keys) and torch.equal(b.values, ref.values)
        assert b.text == h.text and b.model_fingerprint == FP
    st = store.stats()
    assert st["documents"] == 3 and st["chunks"] == 2 + 2 + 1 and st["canonical"] == "tiny"
    assert st["tokens"] == sum(len(t.split()) for t in DOCS.values())
    docs = {d.source: d for d in store.list_documents()}
    assert docs["paris.txt"].chunks == 2 and docs["paris.txt"].metadata == {"lang": "en"}
    assert docs["tokyo.txt"].id == ids["tokyo.txt"]
    assert [h.ord for h in store.chunks_of("paris.txt")] == [0, 1]


def test_search_restricted_to_documents(store: CacheStore):
    ids = ingest(store)
    hits = store.search("capital of Italy Rome Colosseum", k=5, document_ids=[ids["tokyo.txt"]])
    assert hits and {h.source for h in hits} == {"tokyo.txt"}
    assert store.search("anything", k=3, document_ids=[]) == []


def test_search_by_embedding_and_retrieve(store: CacheStore):
    ingest(store)
    q = HashEmbedder(64).embed(["Mount Fuji Japan"])[0]
    hits = store.search(q, k=1)
    assert hits[0].source == "tokyo.txt"
    pairs = store.retrieve("Mount Fuji Japan", k=1)
    assert pairs[0][0].chunk_id == hits[0].chunk_id and pairs[0][1].text == hits[0].text
    with pytest.raises(UsageError):
        store.search("   ", k=1)
    with pytest.raises(UsageError):
        store.search(np.zeros(5, np.float32), k=1)


def test_idempotent_ingest_and_replace(store: CacheStore):
    ingest(store)
    before = store.stats()
    keys_before = set(store.blobs.keys())
    r = store.add_document("rome.txt", DOCS["rome.txt"], {}, chunked(DOCS["rome.txt"]))
    assert r.status == "unchanged"
    assert store.stats()["generation"] == before["generation"]
    assert store.has_document("rome.txt", DOCS["rome.txt"]) and not store.has_document("rome.txt", "x")
    # a new text for the same source replaces its chunks in one step
    new = "Rome is the capital of Italy. It has many fountains."
    r = store.add_document("rome.txt", new, {"v": 2}, chunked(new, per=1))
    assert r.status == "replaced" and r.chunks == 2
    docs = {d.source: d for d in store.list_documents()}
    assert len(docs) == 3 and docs["rome.txt"].metadata == {"v": 2} and docs["rome.txt"].chunks == 2
    assert not any("Tiber" in h.text for h in store.search("Tiber river crosses Rome", k=10))
    # blobs of the old version are gone; the unchanged first sentence's blob is not shared here
    keys = set(store.blobs.keys())
    assert len(keys) == len(keys_before) - 2 + 2
    assert store.doctor().ok


def test_remove_removes_rows_blobs_vectors(store: CacheStore):
    ids = ingest(store)
    n_vec = store._index.ntotal
    paris_keys = {blob_key(b.to_bytes()) for _, b in chunked(DOCS["paris.txt"])}
    assert paris_keys <= set(store.blobs.keys())
    assert store.remove("paris.txt") == 2
    assert paris_keys.isdisjoint(store.blobs.keys())
    assert "paris.txt" not in {d.source for d in store.list_documents()}
    assert VectorIndex.load(store.path / "vectors.safetensors").ntotal == n_vec - 2
    assert all(h.source != "paris.txt" for h in store.search("Eiffel tower Paris", k=10))
    assert store.remove(ids["rome.txt"]) == 2  # by id
    with pytest.raises(UsageError, match="no document"):
        store.remove("paris.txt")
    assert store.doctor().ok


def test_shared_blob_kept_until_last_reference(store: CacheStore):
    same = "Identical sentence here."
    store.add_document("a.txt", same, {}, chunked(same))
    store.add_document("b.txt", same, {}, chunked(same))
    (key,) = set(store.blobs.keys())
    store.remove("a.txt")
    assert store.blobs.contains(key)
    assert store.load_blocks([store.search(same, k=1)[0].chunk_id])[0].text == same
    store.remove("b.txt")
    assert not store.blobs.contains(key)


def test_load_blocks_of_removed_chunk_raises_changed(store: CacheStore):
    ingest(store)
    hit = store.search("Eiffel", k=1)[0]
    store.remove(hit.source)
    with pytest.raises(ChunksChangedError):
        store.load_blocks([hit.chunk_id])


def test_int8_store(tmp_path: Path):
    s = open_store(tmp_path / "q", quantize="int8")
    ingest(s)
    hit = s.search("Colosseum", k=1)[0]
    (b,) = s.load_blocks([hit.chunk_id])
    ref = make_block(hit.text)
    assert (b.keys - ref.keys).abs().max() < 0.05
    assert not torch.equal(b.keys, ref.keys)


# ------------------------------------------------------------------ identity
def test_other_canonical_or_fingerprint_refused(tmp_path: Path):
    p = tmp_path / "s"
    open_store(p).close()
    with pytest.raises(StoreError, match="canonical model 'tiny'"):
        open_store(p, canonical="other")
    with pytest.raises(StoreError, match="fingerprint"):
        open_store(p, fingerprint="another-fp")
    with pytest.raises(StoreError, match="embedder"):
        open_store(p, embedder=HashEmbedder(32))
    s = CacheStore.open(p, create=False)  # reopening without identity uses the recorded one
    assert s.canonical == "tiny" and s.embedder.name == "hash-64"


def test_tokenizer_hash_recorded_and_another_refused(tmp_path: Path):
    p = tmp_path / "s"
    open_store(p, tokenizer_hash="tok-aaaa").close()
    with pytest.raises(StoreError) as err:
        open_store(p, tokenizer_hash="tok-bbbb")
    message = str(err.value)
    assert "tok-aaaa" in message and "tok-bbbb" in message and "\n" not in message
    s = CacheStore.open(p, create=False)  # readers: checked on demand, never recorded
    assert s.tokenizer_hash == "tok-aaaa" and s.stats()["tokenizer_hash"] == "tok-aaaa"
    s.check_tokenizer("tok-aaaa")
    with pytest.raises(StoreError, match="canonical tokenizer tok-aaaa, not tok-bbbb"):
        s.check_tokenizer("tok-bbbb", record=True)
    with pytest.raises(UsageError, match="managed"):
        s.set_meta("tokenizer_hash", "tok-cccc")


def test_store_without_tokenizer_hash_gets_it_recorded(tmp_path: Path):
    """A store made before the tokenizer was recorded: read as before, recorded by the next writer."""
    p = tmp_path / "s"
    with open_store(p) as s:
        ingest(s)
    with CacheStore.open(p, create=False) as s:
        assert s.tokenizer_hash is None
        s.check_tokenizer("tok-aaaa")  # nothing recorded: passes, and a reader records nothing
        assert s.get_meta("tokenizer_hash") is None and s.search("Colosseum", k=1)
        s.check_tokenizer("tok-aaaa", record=True)
    with pytest.raises(StoreError, match="tok-aaaa"):
        open_store(p, tokenizer_hash="tok-bbbb")
    with open_store(p, tokenizer_hash="tok-aaaa") as s:
        assert s.tokenizer_hash == "tok-aaaa" and len(s.list_documents()) == 3


def test_chunking_is_part_of_the_unchanged_key(store: CacheStore):
    text = DOCS["paris.txt"]
    a, b = {"chunker": "x", "chunk_tokens": 8}, {"chunker": "x", "chunk_tokens": 4}
    first = store.add_document("paris.txt", text, {}, chunked(text, per=2), chunking=a)
    assert first.status == "added" and first.chunks == 2
    gen = store.stats()["generation"]
    assert store.add_document("paris.txt", text, {}, chunked(text, per=2), chunking=dict(a)).status == "unchanged"
    assert store.stats()["generation"] == gen and store.has_document("paris.txt", text, a)
    assert not store.has_document("paris.txt", text, b) and not store.has_document("paris.txt", text)
    again = store.add_document("paris.txt", text, {}, chunked(text, per=1), chunking=b)
    assert again.status == "replaced" and again.chunks == 4
    (doc,) = store.list_documents()
    assert doc.chunking == b and doc.chunks == 4 and store.get_document("paris.txt").chunking == b
    assert [h.ord for h in store.chunks_of("paris.txt")] == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="chunking"):
        store.add_document("x.txt", text, {}, chunked(text), chunking={"bad": float("nan")})
    assert store.add_document("paris.txt", text, {}, chunked(text)).status == "replaced"  # none recorded
    assert store.get_document("paris.txt").chunking is None
    assert store.doctor().ok


def _as_schema_v1(store: CacheStore) -> None:
    """Turn a store's catalog into what cagkv wrote before schema version 2."""
    from sqlalchemy import text as sql

    with store.catalog.write() as s:
        s.execute(sql("ALTER TABLE documents DROP COLUMN chunking"))
        store.catalog.set_meta(s, "schema_version", 1)
        s.execute(sql("DELETE FROM meta WHERE key = 'tokenizer_hash'"))


def test_schema_v1_store_is_read_as_is_and_upgraded_by_the_next_write(store: CacheStore):
    ingest(store)
    _as_schema_v1(store)
    url, path = store.catalog.url, store.path
    with CacheStore.open(path, url, create=False) as old:  # a reader: nothing written
        assert {d.chunking for d in old.list_documents()} == {None} and len(old.list_documents()) == 3
        assert old.has_document("rome.txt", DOCS["rome.txt"]) and old.search("Colosseum", k=1)
        old.remove("tokyo.txt")  # writes that need no new column leave the version alone
        assert old.get_meta("schema_version") == 1
    with open_store(path, db_url=url) as s:
        rome = DOCS["rome.txt"]
        assert s.add_document("rome.txt", rome, {}, chunked(rome)).status == "unchanged"  # None == not recorded
        assert s.get_meta("schema_version") == 2
        params = {"chunker": "x", "chunk_tokens": 8}
        assert s.add_document("rome.txt", rome, {}, chunked(rome), chunking=params).status == "replaced"
        assert s.add_document("rome.txt", rome, {}, chunked(rome), chunking=params).status == "unchanged"
        docs = {d.source: d.chunking for d in s.list_documents()}
        assert docs == {"paris.txt": None, "rome.txt": params}
        assert s.doctor().ok


def test_block_of_another_model_refused(store: CacheStore):
    text = "A sentence from another model."
    with pytest.raises(StoreError, match="canonical model"):
        store.add_document("x.txt", text, {}, chunked(text, fp="other-fp"))
    assert store.list_documents() == []
    assert store.doctor(repair=True).checked_chunks == 0
    assert list(store.blobs.keys()) == []


def test_missing_store_without_create(tmp_path: Path):
    with pytest.raises(StoreError, match="no cagkv store"):
        CacheStore.open(tmp_path / "nope", create=False)


def test_store_path_under_a_file(tmp_path: Path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot create store"):
        open_store(tmp_path / "file" / "s")


def test_unwritable_store(tmp_path: Path):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(StoreError):
        open_store(ro / "s")


def test_schema_version_mismatch(tmp_path: Path):
    p = tmp_path / "s"
    s = open_store(p)
    with s.catalog.write() as sess:
        s.catalog.set_meta(sess, "schema_version", 999)
    s.close()
    with pytest.raises(StoreError, match="schema version 999"):
        open_store(p)


def test_catalog_caught_mid_creation_reads_as_not_there_yet(tmp_path: Path):
    """Between the creator's table commit and its meta rows, an opener without the write lock
    must not call the catalog broken (schema version None) but go and wait for the creator."""
    from cagkv.stores.catalog import SCHEMA_VERSION, Base, Catalog, Meta, NoCatalogError, sqlite_url
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    p = tmp_path / "s"
    p.mkdir()
    url = sqlite_url(p / "catalog.db")
    engine = create_engine(url)
    Base.metadata.create_all(engine)  # the creator's first step, committed
    with pytest.raises(NoCatalogError, match="still being created"):
        Catalog(url, create=False)
    with Session(engine) as sess, sess.begin():  # the creator's second step
        sess.add_all([Meta(key="schema_version", value=SCHEMA_VERSION), Meta(key="generation", value=0),
                      Meta(key="store_id", value="x")])
    engine.dispose()
    open_store(p).close()


@pytest.mark.parametrize("url", ["notaurl", "postgresql+psycopg://u:secret@127.0.0.1:1/db", "nosuchdialect://x"])
def test_bad_database_url(tmp_path: Path, url: str):
    with pytest.raises(StoreError) as e:
        open_store(tmp_path / "s", db_url=url)
    assert "secret" not in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ bad input at the store level
def test_bad_chunks_refused_and_store_unchanged(store: CacheStore):
    ingest(store)
    gen = store.stats()["generation"]
    text = "One sentence. Two sentence."
    good = chunked(text)
    with pytest.raises(UsageError, match="does not match"):
        store.add_document("y.txt", text, {}, [(TextChunk(good[0][0].text, 1, 5), good[0][1])])
    with pytest.raises(UsageError, match="embeddings must be"):
        store.add_document("y.txt", text, {}, good, embeddings=np.zeros((3, 64), np.float32))
    with pytest.raises(UsageError, match="NaN"):
        store.add_document("y.txt", text, {}, good, embeddings=np.full((1, 64), np.nan, np.float32))
    with pytest.raises(UsageError):
        store.add_document("", text, {}, good)
    with pytest.raises(UsageError, match="JSON"):
        store.add_document("y.txt", text, {"x": object()}, good)
    assert store.stats()["generation"] == gen
    assert "y.txt" not in {d.source for d in store.list_documents()}


# ------------------------------------------------------------------ doctor
def test_doctor_clean_store(store: CacheStore):
    ingest(store)
    r = store.doctor()
    assert r.ok and r.checked_chunks == 5 and not r.problems


def test_doctor_finds_and_repairs(store: CacheStore):
    ingest(store)
    (pc0, _), _ = chunked(DOCS["paris.txt"])
    rome_key = blob_key(chunked(DOCS["rome.txt"])[0][1].to_bytes())
    paris_key = blob_key(chunked(DOCS["paris.txt"])[0][1].to_bytes())
    # flip a byte in one blob, delete another, add an orphan, delete the index
    p = store.blobs.root / rome_key
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(bytes(raw))
    (store.blobs.root / paris_key).unlink()
    store.blobs.put("zz/orphan.kv", b"orphan")
    (store.path / "vectors.safetensors").unlink()
    r = store.doctor()
    kinds = sorted(p.kind for p in r.problems)
    assert not r.ok and kinds == ["corrupt_blob", "index", "missing_blob", "orphan_blob"]
    msgs = {p.kind: p for p in r.problems}
    assert msgs["corrupt_blob"].document == "rome.txt" and msgs["corrupt_blob"].chunk == 0
    assert "rome.txt" in msgs["corrupt_blob"].message and "chunk 0" in msgs["corrupt_blob"].message
    assert msgs["missing_blob"].document == "paris.txt"
    # reads name the document and chunk too, never answering from the corrupt blob
    rome_hit = next(h for h in store.search("Rome Italy capital", k=5) if h.source == "rome.txt" and h.ord == 0)
    with pytest.raises(CorruptBlobError, match="rome.txt.*chunk 0"):
        store.load_blocks([rome_hit.chunk_id])
    r2 = store.doctor(repair=True)
    assert r2.repaired and any("quarantined" in x for x in r2.repaired)
    assert {d.source for d in store.list_documents()} == {"tokyo.txt"}
    assert store.doctor().ok
    assert list((store.blobs.root / "quarantine").iterdir())
    # re-ingest restores the removed documents
    ingest(store)
    assert store.doctor().ok and store.stats()["chunks"] == 5


def test_doctor_stale_index_rebuilt(store: CacheStore):
    ingest(store, {"paris.txt": DOCS["paris.txt"]})
    stale = (store.path / "vectors.safetensors").read_bytes()
    ingest(store, {"rome.txt": DOCS["rome.txt"]})
    (store.path / "vectors.safetensors").write_bytes(stale)
    # a fresh reader notices the stale file and answers from the catalog's snapshot
    reader = CacheStore.open(store.path, store.catalog.url, create=False)
    assert any(h.source == "rome.txt" for h in reader.search("Colosseum Rome", k=3))
    r = store.doctor()
    assert [p.kind for p in r.problems] == ["index"] and "stale" in r.problems[0].message
    store.doctor(repair=True)
    assert store.doctor().ok


def test_doctor_checksum_edited_row(store: CacheStore):
    ingest(store)
    with store.catalog.write() as s:
        from cagkv.stores.catalog import Chunk

        c = s.get(Chunk, 1)
        c.checksum = "0" * 64
    r = store.doctor()
    assert [p.kind for p in r.problems] == ["corrupt_blob"] and "paris.txt" in r.problems[0].message
    with pytest.raises(CorruptBlobError, match="paris.txt"):
        store.load_blocks([1])


def test_path_traversal_blob_key_in_row(store: CacheStore, tmp_path: Path):
    ingest(store)
    secret = tmp_path / "secret.kv"
    secret.write_bytes(b"x")
    with store.catalog.write() as s:
        from cagkv.stores.catalog import Chunk

        s.get(Chunk, 1).blob_key = "../../secret.kv"
    with pytest.raises(CorruptBlobError, match="invalid blob key"):
        store.load_blocks([1])
    r = store.doctor(repair=True)
    assert any(p.kind == "bad_row" for p in r.problems)
    assert secret.exists()
    assert store.doctor().ok


# ------------------------------------------------------------------ blobs
@pytest.mark.parametrize(
    "key", ["../x", "/etc/passwd", "a/../../b", "a\\b", "", ".hidden", "a//b", "x.tmp", "quarantine/x", "a/./b"]
)
def test_blob_keys_cannot_escape(key: str, tmp_path: Path):
    with pytest.raises(ValueError):
        check_key(key)
    with pytest.raises(ValueError):
        LocalBlobStore(tmp_path).put(key, b"x")


@pytest.mark.parametrize("url", ["local", "memory://cagkv-test-blobs"])
def test_blob_store_contract(url: str, tmp_path: Path):
    blobs = open_blob_store(tmp_path / "b" if url == "local" else f"{url}/{tmp_path.name}")
    sha = blobs.put("ab/one.kv", b"hello")
    assert blobs.contains("ab/one.kv") and not blobs.contains("ab/two.kv")
    assert blobs.get("ab/one.kv", expected_sha=sha) == b"hello"
    assert blobs.get("ab/two.kv") is None
    with pytest.raises(CorruptBlobError, match="ab/one.kv"):
        blobs.get("ab/one.kv", expected_sha="0" * 64)
    blobs.put("cd/two.kv", b"x")
    assert sorted(blobs.keys()) == ["ab/one.kv", "cd/two.kv"]
    assert blobs.quarantine("cd/two.kv")
    assert sorted(blobs.keys()) == ["ab/one.kv"]
    assert blobs.remove("ab/one.kv") and not blobs.remove("ab/one.kv")


def test_blob_store_unknown_scheme():
    with pytest.raises(StoreError, match="unknown blob store scheme"):
        open_blob_store("nosuch://bucket")


def test_store_with_fsspec_blobs(tmp_path: Path):
    s = open_store(tmp_path / "s", blob_url=f"memory://cagkv-store-{tmp_path.name}")
    ingest(s)
    hit = s.search("Tiber", k=1)[0]
    assert s.load_blocks([hit.chunk_id])[0].text == hit.text
    s.remove("rome.txt")
    assert s.doctor().ok


def test_symlinked_blob_refused(store: CacheStore, tmp_path: Path):
    ingest(store)
    key = blob_key(chunked(DOCS["tokyo.txt"])[0][1].to_bytes())
    p = store.blobs.root / key
    target = tmp_path / "elsewhere.kv"
    target.write_bytes(p.read_bytes())
    p.unlink()
    p.symlink_to(target)
    hit = store.search("Fuji", k=1)[0]
    with pytest.raises(CorruptBlobError, match="link"):
        store.load_blocks([hit.chunk_id])


def test_interrupted_blob_write_leaves_no_partial_blob(tmp_path: Path, monkeypatch):
    blobs = LocalBlobStore(tmp_path)

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        blobs.put("ab/x.kv", b"data")
    assert not blobs.contains("ab/x.kv") and list(tmp_path.rglob("*.tmp")) == []


# ------------------------------------------------------------------ vectors + embedders
def test_vector_index_persist_and_corruption(tmp_path: Path):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((10, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx = VectorIndex.build(16, np.arange(100, 110), vecs, generation=7)
    assert idx.search(vecs[3], 1)[0][0] == 103
    assert [i for i, _ in idx.search(vecs[3], 5, allowed_ids=[105, 106])] in ([105, 106], [106, 105])
    assert idx.remove([103]) == 1 and 103 not in idx.ids()
    p = tmp_path / "v.safetensors"
    idx.save(p)
    back = VectorIndex.load(p)
    assert back.generation == 7 and back.ntotal == 9 and VectorIndex.read_stamp(p) == ("", 7)
    raw = bytearray(p.read_bytes())
    raw[-10] ^= 0xFF
    p.write_bytes(bytes(raw))
    from cagkv.stores import CorruptIndexError

    with pytest.raises(CorruptIndexError, match="checksum"):
        VectorIndex.load(p)
    p.write_bytes(bytes(raw[:50]))
    with pytest.raises(CorruptIndexError):
        VectorIndex.load(p)


def test_hash_embedder_deterministic_and_normalised():
    e = HashEmbedder(64)
    a = e.embed(["the cat sat", "the cat sat", "quantum chromodynamics"])
    assert a.dtype == np.float32 and a.shape == (3, 64)
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(a[0], a[1]) and a[0] @ a[1] > a[0] @ a[2]


def test_kv_layout_fixed_by_first_block(store: CacheStore):
    ingest(store, {"a.txt": DOCS["rome.txt"]})
    assert store.stats()["kv_layout"] == {
        "dtype": "float32", "layers": 2, "heads": 1, "head_dim": 8, "positions_free": True,
    }  # fmt: skip
    text = "Another layout entirely."
    other = make_block(text, layers=3)
    with pytest.raises(StoreError, match="KV layout"):
        store.add_document("b.txt", text, {}, [(TextChunk(text, 0, len(text)), other)])
    bf16 = make_block(text)
    bf16 = KVBlock(bf16.keys.bfloat16(), bf16.values.bfloat16(), bf16.token_ids, bf16.offsets, text, FP)
    with pytest.raises(StoreError, match="KV layout"):
        store.add_document("b.txt", text, {}, [(TextChunk(text, 0, len(text)), bf16)])
    assert "b.txt" not in {d.source for d in store.list_documents()}


def test_ids_as_strings_accepted(store: CacheStore):
    ids = ingest(store)
    hits = store.search("Colosseum Rome", k=2, document_ids=[str(ids["rome.txt"])])
    assert hits and all(h.source == "rome.txt" for h in hits)
    assert store.load_blocks([str(hits[0].chunk_id)])[0].text == hits[0].text
    with pytest.raises(UsageError):
        store.search("Rome", k=1, document_ids=["rome.txt"])
    with pytest.raises(UsageError):
        store.remove(3.5)


def test_long_source_is_fine(store: CacheStore):
    src = "dir/" * 900 + "file.txt"  # 3.6k characters: beyond a PostgreSQL btree entry
    text = "A document with a very long path."
    store.add_document(src, text, {}, chunked(text))
    assert store.get_document(src).source == src and store.has_document(src, text)
    assert store.remove(src) == 1


def test_threads_share_one_handle(store: CacheStore):
    """4 reader threads and a writer thread on one CacheStore: no error, consistent blocks."""
    import threading

    ingest(store)
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            n = 0
            while not done.is_set() or n < 3:
                for hit, block in store.retrieve("Paris Eiffel Seine Rome Tokyo", k=3):
                    assert block.text == hit.text and torch.equal(block.keys, make_block(hit.text).keys)
                n += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for t in readers:
        t.start()
    for v in range(6):
        text = f"Paris version {v} of the text. The Seine is long."
        store.add_document("paris.txt", text, {}, chunked(text, per=1))
        store.remove("tokyo.txt") if v % 2 == 0 else ingest(store, {"tokyo.txt": DOCS["tokyo.txt"]})
    done.set()
    for t in readers:
        t.join(60)
    assert not errors, errors[0]
    assert store.doctor().ok
