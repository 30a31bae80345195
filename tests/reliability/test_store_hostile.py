"""Hostile and bad input at the store level: each is a one-line typed error, the store unchanged.

(File-level hostile input -- symlinks, FIFOs, binary files, size limits -- is the ingest
layer's and is tested with the CLI.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cagkv.stores import CacheStore
from storekit import DIM, TextChunk, add, chunked, doc_text, make_block, open_store, question

from cagkv.errors import CagkvError, StoreError, UsageError


def _snapshot(s: CacheStore) -> tuple:
    """Everything a write could change: generation, rows, blob keys, index file bytes."""
    st = s.stats()
    idx = (s.path / "vectors.safetensors").read_bytes() if (s.path / "vectors.safetensors").exists() else b""
    return st["generation"], st["documents"], st["chunks"], sorted(s.blobs.keys()), idx


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = open_store(tmp_path / "store")
    for i in range(2):
        add(s, f"doc{i}.txt", doc_text(i))
    yield s
    s.close()


TEXT = "Hostile input is refused. The store stays the same."
BAD_ADDS = {
    "huge_metadata": dict(metadata={"x": "a" * 300_000}),
    "deep_metadata": dict(metadata=(_deep := {})),
    "nan_metadata": dict(metadata={"x": float("nan")}),
    "object_metadata": dict(metadata={"x": {1, 2}}),
    "surrogate_metadata": dict(metadata={"x": "\ud800"}),
    "nul_source": dict(source="a\x00b"),
    "surrogate_source": dict(source="bad\udcff.txt"),
    "long_source": dict(source="s" * 5000),
    "empty_source": dict(source=""),
    "blank_source": dict(source="  \n\t"),
    "non_string_source": dict(source=123),
    "nul_text": dict(text=TEXT + "\x00"),
    "bytes_text": dict(text=TEXT.encode()),
    "span_outside_text": dict(chunks=[(TextChunk(TEXT, 5, 10_000), make_block(TEXT))]),
    "span_text_mismatch": dict(chunks=[(TextChunk("Hostile input", 1, 14), make_block("Hostile input"))]),
    "block_text_mismatch": dict(chunks=[(TextChunk(TEXT, 0, len(TEXT)), make_block("something else"))]),
    "not_a_block": dict(chunks=[(TextChunk(TEXT, 0, len(TEXT)), b"raw bytes")]),
    "wrong_model_block": dict(chunks=[(TextChunk(TEXT, 0, len(TEXT)), make_block(TEXT, fp="evil-model"))]),
    "embedding_wrong_dim": dict(embeddings=np.ones((1, DIM + 1), np.float32)),
    "embedding_wrong_count": dict(embeddings=np.ones((5, DIM), np.float32)),
    "embedding_inf": dict(embeddings=np.full((1, DIM), np.inf, np.float32)),
}
_d = _deep
for _ in range(5000):
    _d["x"] = {}
    _d = _d["x"]


@pytest.mark.parametrize("case", sorted(BAD_ADDS))
def test_bad_add_refused_store_unchanged(case: str, store: CacheStore):
    before = _snapshot(store)
    kw: dict[str, Any] = {
        "source": "hostile.txt",
        "text": TEXT,
        "metadata": {},
        "chunks": [(TextChunk(TEXT, 0, len(TEXT)), make_block(TEXT))],
    }
    kw.update(BAD_ADDS[case])
    with pytest.raises(CagkvError) as e:
        store.add_document(**kw)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    assert _snapshot(store) == before
    assert store.doctor().ok


def test_failing_chunk_stream_leaves_store_unchanged(store: CacheStore):
    """The chunk generator dies half-way (e.g. the model crashed): no row, no vector."""
    before = _snapshot(store)

    def pairs():
        yield from chunked(doc_text(7))[:2]
        raise RuntimeError("prefill died")

    with pytest.raises(RuntimeError):
        store.add_document("doc7.txt", doc_text(7), {}, pairs())
    assert _snapshot(store) == before  # the blobs it had written are removed again
    assert store.doctor().ok


@pytest.mark.parametrize(
    "source",
    [
        "../../../etc/passwd",
        "/absolute/path.txt",
        "C:\\windows\\system32",
        "emoji 📚🔥.md",
        "עברית-RTL\u202e.txt",
        "zero\u200bwidth",
        "combining e\u0301\u0301\u0301",
        "line\nbreak",
        "中文文件名.txt",
        "s3://bucket/key?x=1&y=2#frag",
        "'; DROP TABLE documents; --",
    ],
)
def test_weird_sources_are_just_names(source: str, store: CacheStore, tmp_path: Path):
    """Sources are opaque strings: stored and found exactly, never used as paths."""
    outside = set(tmp_path.parent.iterdir())
    r = store.add_document(source, TEXT, {"s": source}, chunked(TEXT))
    assert store.get_document(source).id == r.document_id
    assert store.get_document(source).metadata == {"s": source}
    assert store.retrieve(TEXT, k=1)[0][0].source == source
    assert store.add_document(source, TEXT, {}, chunked(TEXT)).status == "unchanged"
    assert store.remove(source) == 1
    assert set(tmp_path.parent.iterdir()) == outside
    assert not list(Path(store.path).rglob("passwd"))
    assert store.doctor().ok


def test_big_but_legal_metadata_round_trips(store: CacheStore):
    meta = {"k": "v" * 200_000, "nested": {"list": list(range(1000))}, "uni": "📚" * 100}
    store.add_document("big.txt", TEXT, meta, chunked(TEXT))
    assert store.get_document("big.txt").metadata == meta


def test_extremely_long_single_line_chunk(store: CacheStore):
    text = "word " * 20_000  # one 100k-character line, one chunk
    text = text.strip() + "."
    store.add_document("long.txt", text, {}, [(TextChunk(text, 0, len(text)), make_block(text))])
    (hit, block), = store.retrieve("word word word", k=1)
    assert hit.source == "long.txt" and block.num_tokens == 20_000


@pytest.mark.parametrize(
    "url,match",
    [
        ("postgresql+psycopg://user:hunter2@127.0.0.1:1/db", "cannot open catalog"),
        ("sqlite:////nonexistent-dir/sub/catalog.db", "cannot open catalog"),
        ("mysql+nosuchdriver://x/y", "invalid database URL"),
        ("not a url at all", "invalid database URL"),
    ],
)
def test_wrong_database_url(url: str, match: str, tmp_path: Path):
    with pytest.raises(StoreError, match=match) as e:
        open_store(tmp_path / "s", url)
    assert "hunter2" not in str(e.value) and "\n" not in str(e.value)


def test_store_of_another_canonical_unchanged(tmp_path: Path):
    s = open_store(tmp_path / "s")
    add(s, "doc0.txt", doc_text(0))
    before = _snapshot(s)
    with pytest.raises(StoreError, match="canonical"):
        CacheStore.open(tmp_path / "s", canonical="another-model")
    assert _snapshot(s) == before


def test_foreign_files_in_blob_folder_ignored(store: CacheStore):
    """Files a user drops into blobs/ with names that are not keys are not listed or removed as orphans."""
    odd = store.path / "blobs" / ".DS_Store"
    odd.write_bytes(b"x")
    assert ".DS_Store" not in set(store.blobs.keys())
    store.doctor(repair=True)
    assert odd.exists()


def test_reader_on_read_only_store(store: CacheStore, tmp_path: Path):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    for p in [store.path, *store.path.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        r = CacheStore.open(store.path, create=False)
        assert r.search(question(0, 3), k=1)
        with pytest.raises((StoreError, UsageError)):
            add(r, "x.txt", TEXT)
    finally:
        for p in [store.path, *store.path.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
