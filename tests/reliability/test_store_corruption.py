"""Corruption: every damaged blob, index or row is detected, named and repairable.

For each case the store holds documents 0-3; one thing is damaged; then:
  - reading the damaged chunk raises CorruptBlobError naming its document and chunk,
    and `retrieve` never answers from it (nothing is served silently);
  - `doctor()` reports it (naming document and chunk for blob damage);
  - `doctor(repair=True)` quarantines bad blobs, drops the affected document's rows and
    rebuilds the index; afterwards `doctor()` is clean, the other documents still load,
    and re-ingesting the affected document restores the store.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from cagkv.stores.blobs import sha256
from cagkv.stores.catalog import Chunk, Document
from cagkv.stores.records import blob_key
from safetensors.torch import save
from sqlalchemy import select
from storekit import FP, TextChunk, add, answer, doc_text, make_block, open_store, question

from cagkv.errors import CorruptBlobError
from cagkv.kv import KVBlock


def _setup(path: Path) -> Any:
    s = open_store(path)
    for i in range(4):
        add(s, f"doc{i}.txt", doc_text(i))
    return s


def _victim(s: Any) -> Any:
    """Chunk 1 of doc2."""
    with s.catalog.read() as sess:
        return sess.execute(
            select(Chunk.id, Chunk.ord, Chunk.blob_key, Chunk.checksum, Chunk.text)
            .join(Document)
            .where(Document.source == "doc2.txt", Chunk.ord == 1)
        ).one()


def _forge_block_bytes(text: str, *, fp: str = FP, nan: bool = False) -> bytes:
    """Bytes of a block for `text` with NaN values or another fingerprint, written behind to_bytes' back."""
    b = make_block(text, fp=fp)
    raw = b.to_bytes() if not nan else None
    if nan:
        good = make_block(text).to_bytes()
        n = int.from_bytes(good[:8], "little")
        meta = json.loads(good[8 : 8 + n])["__metadata__"]
        v = b.values.clone()
        v[0, 0, 0, 0] = float("nan")
        raw = save({"keys": b.keys, "values": v, "token_ids": b.token_ids, "offsets": b.offsets}, meta)
    return raw


def _repoint(s: Any, chunk_id: int, data: bytes) -> None:
    """Write `data` as a new blob and point the chunk row at it with a matching checksum."""
    key = blob_key(data)
    s.blobs.put(key, data)
    with s.catalog.write() as sess:
        row = sess.get(Chunk, chunk_id)
        row.blob_key, row.checksum = key, sha256(data)


def _blob_path(s: Any, key: str) -> Path:
    return s.blobs.root / key


BLOB_CASES = {
    "flip_header_byte": lambda s, v: _flip(_blob_path(s, v.blob_key), 20),
    "flip_tensor_byte": lambda s, v: _flip(_blob_path(s, v.blob_key), -7),
    "truncate": lambda s, v: _blob_path(s, v.blob_key).write_bytes(_blob_path(s, v.blob_key).read_bytes()[:100]),
    "empty_file": lambda s, v: _blob_path(s, v.blob_key).write_bytes(b""),
    "delete": lambda s, v: _blob_path(s, v.blob_key).unlink(),
    "replaced_by_dir": lambda s, v: (_blob_path(s, v.blob_key).unlink(), _blob_path(s, v.blob_key).mkdir()),
    "other_chunks_bytes": lambda s, v: _blob_path(s, v.blob_key).write_bytes(make_block("Other text.").to_bytes()),
    "row_checksum_edited": lambda s, v: _edit_row(s, v.id, checksum="f" * 64),
    "nan_values_valid_checksum": lambda s, v: _repoint(s, v.id, _forge_block_bytes(v.text, nan=True)),
    "other_model_valid_checksum": lambda s, v: _repoint(s, v.id, _forge_block_bytes(v.text, fp="other-model")),
    "other_text_valid_checksum": lambda s, v: _repoint(s, v.id, make_block(v.text + " x").to_bytes()),
    "row_key_traversal": lambda s, v: _edit_row(s, v.id, blob_key="../../catalog.db"),
}


def _flip(p: Path, at: int) -> None:
    raw = bytearray(p.read_bytes())
    raw[at] ^= 0x5A
    p.write_bytes(bytes(raw))


def _edit_row(s: Any, chunk_id: int, **values: Any) -> None:
    with s.catalog.write() as sess:
        row = sess.get(Chunk, chunk_id)
        for k, v in values.items():
            setattr(row, k, v)


@pytest.mark.parametrize("case", sorted(BLOB_CASES))
def test_blob_corruption(case: str, tmp_path: Path):
    s = _setup(tmp_path / "store")
    v = _victim(s)
    BLOB_CASES[case](s, v)
    # reading it fails loudly, naming the document and chunk
    with pytest.raises(CorruptBlobError, match=r"doc2\.txt.*chunk 1"):
        s.load_blocks([v.id])
    # a question answered by that chunk is refused, not answered from a bad cache
    with pytest.raises(CorruptBlobError, match=r"doc2\.txt"):
        s.retrieve(question(2, 3), k=1)
    # other documents are still served
    assert answer(s, question(1, 3))[0] == "doc1.txt"
    report = s.doctor()
    assert not report.ok
    bad = [p for p in report.problems if p.kind in ("corrupt_blob", "missing_blob", "bad_row")]
    assert bad and all(p.document == "doc2.txt" and p.chunk == 1 for p in bad), report.problems
    s.doctor(repair=True)
    assert s.doctor().ok
    assert "doc2.txt" not in {d.source for d in s.list_documents()}
    assert answer(s, question(3, 3))[0] == "doc3.txt"
    assert (tmp_path / "store" / "catalog.db").exists()  # the traversal case touched nothing outside
    add(s, "doc2.txt", doc_text(2))
    assert answer(s, question(2, 3))[0] == "doc2.txt" and s.doctor().ok


INDEX_CASES = ["delete", "truncate", "flip_byte", "stale_copy", "other_store", "garbage"]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_damage(case: str, tmp_path: Path):
    s = _setup(tmp_path / "store")
    idx = tmp_path / "store" / "vectors.safetensors"
    if case == "delete":
        idx.unlink()
    elif case == "truncate":
        idx.write_bytes(idx.read_bytes()[:200])
    elif case == "flip_byte":
        _flip(idx, -20)
    elif case == "garbage":
        idx.write_bytes(random.Random(0).randbytes(4096))
    elif case == "stale_copy":
        old = tmp_path / "old"
        o = open_store(old)
        for i in range(2):
            add(o, f"doc{i}.txt", doc_text(i))
        idx.write_bytes((old / "vectors.safetensors").read_bytes())
    elif case == "other_store":  # same generation, same chunk ids, other vectors
        o = open_store(tmp_path / "other")
        for i in range(4, 8):
            add(o, f"doc{i}.txt", doc_text(i))
        idx.write_bytes((tmp_path / "other" / "vectors.safetensors").read_bytes())
    # a fresh reader answers from the catalog's snapshot, never from the damaged index
    r = open_store(tmp_path / "store", create=False)
    for i in range(4):
        assert answer(r, question(i, 3))[0] == f"doc{i}.txt"
    report = s.doctor()
    assert [p.kind for p in report.problems] == ["index"], report.problems
    s.doctor(repair=True)
    assert s.doctor().ok


def test_nan_block_refused_at_write(tmp_path: Path):
    s = _setup(tmp_path / "store")
    text = "A sentence with a NaN cache."
    b = make_block(text)
    b.keys[0, 0, 0, 0] = float("inf")
    gen = s.stats()["generation"]
    with pytest.raises(CorruptBlobError, match="NaN or Inf"):
        s.add_document("nan.txt", text, {}, [(TextChunk(text, 0, len(text)), b)])
    assert s.stats()["generation"] == gen and s.doctor().ok


def test_random_mutations_never_crash_the_reader(tmp_path: Path):
    """300 random byte flips / truncations of a block: either parsed or CorruptBlobError, nothing else."""
    raw = make_block(doc_text(0)[:200]).to_bytes("int8")
    rng = random.Random(1)
    outcomes = {"parsed": 0, "refused": 0}
    for _ in range(300):
        b = bytearray(raw)
        if rng.random() < 0.3:
            b = b[: rng.randrange(len(b))]
        else:
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(min(len(b), 400)) if rng.random() < 0.7 else rng.randrange(len(b))
                b[pos] = rng.randrange(256)
        try:
            blk = KVBlock.from_bytes(bytes(b))
            assert torch.isfinite(blk.keys).all() and blk.keys.dim() == 4
            outcomes["parsed"] += 1
        except CorruptBlobError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100
