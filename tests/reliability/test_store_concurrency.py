"""Concurrency: 4 reader processes ask questions while a writer ingests, replaces and removes.

Readers take no lock. Every answer must be consistent with some committed state: the
hit's text is a chunk of a document version that was written, its KV block is exactly
the block made from that text (no partial or mismatched read), and questions about
documents nobody touches always find them. No reader may raise. Runs on SQLite (WAL)
and, when a server is set, on PostgreSQL.
"""

from __future__ import annotations

import hashlib
import queue
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from storekit import add, chunked, doc_text, forkserver, make_block, open_store, question, wait_all

STABLE = range(1, 5)  # documents nobody touches
VERSIONS = 6  # versions of doc0 written by the writer
CHURN = range(20, 28)  # documents added then removed by the writer


def _digest(block: Any) -> str:
    return hashlib.sha256(block.keys.numpy().tobytes() + block.values.numpy().tobytes()).hexdigest()


def writer(path: str, db_url: str | None) -> None:
    s = open_store(path, db_url)
    for v in range(1, VERSIONS + 1):
        add(s, "doc0.txt", doc_text(0, version=v))
        i = CHURN[v % len(CHURN)]
        if s.has_document(f"doc{i}.txt", doc_text(i)):
            s.remove(f"doc{i}.txt")
        else:
            add(s, f"doc{i}.txt", doc_text(i))
    s.close()


def reader(path: str, db_url: str | None, rid: int, stop: Any, out: Any) -> None:
    """Ask until told to stop; put ("ok", n) or ("error", traceback) on `out`."""
    allowed0 = {c.text for v in range(VERSIONS + 1) for c, _ in chunked(doc_text(0, version=v))}
    churn_texts = {c.text for i in CHURN for c, _ in chunked(doc_text(i))}
    churn_sources = {f"doc{i}.txt" for i in CHURN}
    n = 0
    torch.set_num_threads(1)
    try:
        s = open_store(path, db_url, create=False)
        while not stop.is_set() or n < 5:
            i = (rid + n) % 5
            for hit, block in s.retrieve(question(i, 3), k=3):
                assert block.text == hit.text, "a block served for another chunk's text"
                assert _digest(block) == _digest(make_block(hit.text)), "a partial or foreign KV block"
                if hit.source == "doc0.txt":
                    assert hit.text in allowed0, "doc0 text from no written version"
                elif hit.source in churn_sources:
                    assert hit.text in churn_texts, "churned document text from no written version"
            top = s.search(question(i, 3), k=1)[0]
            if i in STABLE:
                assert top.source == f"doc{i}.txt", f"question about doc{i} answered from {top.source}"
            n += 1
            time.sleep(0.05)  # leave the (2-core) machine some time for the writer
        s.close()
        out.put(("ok", n))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _run(path: Path, db_url: str | None) -> list[int]:
    s = open_store(path, db_url)
    for i in range(5):
        add(s, f"doc{i}.txt", doc_text(i))
    for i in STABLE:  # the test's premise: these questions find their document
        assert s.search(question(i, 3), k=1)[0].source == f"doc{i}.txt"
    s.close()
    ctx = forkserver()
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=reader, args=(str(path), db_url, r, stop, out), name=f"reader{r}") for r in range(4)]
    w = ctx.Process(target=writer, args=(str(path), db_url), name="writer")
    t0 = time.monotonic()
    for p in readers:
        p.start()
    w.start()
    wait_all([w], timeout=150)
    stop.set()
    wait_all(readers, timeout=60)
    assert w.exitcode == 0, "the writer failed"
    results = []
    for _ in readers:
        try:
            results.append(out.get(timeout=10))
        except queue.Empty:
            pytest.fail("a reader died without reporting")
    errors = [r[1] for r in results if r[0] == "error"]
    assert not errors, errors[0]
    s = open_store(path, db_url)
    assert s.doctor().ok
    assert s.get_document("doc0.txt").content_hash == hashlib.sha256(doc_text(0, VERSIONS).encode()).hexdigest()
    s.close()
    print(f"writer + 4 readers: {time.monotonic() - t0:.1f} s, reads per reader {[r[1] for r in results]}")
    return [r[1] for r in results]


def test_readers_and_writer_sqlite(tmp_path: Path):
    counts = _run(tmp_path / "store", None)
    assert all(c >= 5 for c in counts)


@pytest.mark.postgres
def test_readers_and_writer_postgres(tmp_path: Path, pg_url: str):
    counts = _run(tmp_path / "store", pg_url)
    assert all(c >= 5 for c in counts)


def test_two_writers_serialise(tmp_path: Path):
    """Two writer processes on one store: the lock serialises them, both succeed."""
    path = tmp_path / "store"
    open_store(path).close()
    ctx = forkserver()
    ws = [ctx.Process(target=_write_many, args=(str(path), w)) for w in range(2)]
    for p in ws:
        p.start()
    wait_all(ws, timeout=120)
    assert [p.exitcode for p in ws] == [0, 0]
    s = open_store(path)
    assert len(s.list_documents()) == 2 * 4 and s.doctor().ok


def _write_many(path: str, w: int) -> None:
    s = open_store(path)
    for i in range(4):
        add(s, f"w{w}-doc{i}.txt", doc_text(100 * (w + 1) + i))
    s.close()


def test_lock_timeout_is_a_clear_error(tmp_path: Path):
    import fcntl
    import os

    from cagkv.errors import StoreError

    path = tmp_path / "store"
    open_store(path).close()
    fd = os.open(path / "write.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        s = open_store(path, lock_timeout=0.3)
        with pytest.raises(StoreError, match="busy"):
            add(s, "x.txt", doc_text(9))
        assert s.search(question(9, 3), k=1) == []  # readers still work
    finally:
        os.close(fd)


def _create_and_add(path: str, w: int) -> None:
    s = open_store(path)
    add(s, f"c{w}.txt", doc_text(300 + w))
    s.close()


def test_concurrent_creation_of_one_store(tmp_path: Path):
    """Four processes create the same new store at once: one creates, all succeed."""
    ctx = forkserver()
    ps = [ctx.Process(target=_create_and_add, args=(str(tmp_path / "new"), w)) for w in range(4)]
    for p in ps:
        p.start()
    wait_all(ps, timeout=120)
    assert [p.exitcode for p in ps] == [0] * 4
    s = open_store(tmp_path / "new")
    assert len(s.list_documents()) == 4 and s.doctor().ok
