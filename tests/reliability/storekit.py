"""Helpers for the reliability tests: synthetic documents, KV blocks, worker processes.

Worker processes come from a multiprocessing *forkserver* that preloads cagkv once, so a
child starts in milliseconds instead of re-importing torch (seconds on this machine);
`Process.kill()` is a real SIGKILL.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cagkv.stores import CacheStore, HashEmbedder

from cagkv.kv import KVBlock

FP = "fp-reliability-01"
DIM = 256


@dataclass
class TextChunk:
    text: str
    start: int
    end: int


def make_block(text: str, fp: str = FP) -> KVBlock:
    words = list(re.finditer(r"\S+", text))
    t = len(words)
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    return KVBlock(
        keys=torch.randn(2, 2, t, 16, generator=g),
        values=torch.randn(2, 2, t, 16, generator=g),
        token_ids=torch.arange(t, dtype=torch.int64),
        offsets=torch.tensor([[m.start(), m.end()] for m in words], dtype=torch.int64).reshape(t, 2),
        text=text,
        model_fingerprint=fp,
    )


def chunked(text: str, per: int = 2) -> list[tuple[TextChunk, KVBlock]]:
    spans = [m.span() for m in re.finditer(r"[^.]+\.?", text) if m.group().strip()]
    out = []
    for i in range(0, len(spans), per):
        s, e = spans[i][0], spans[min(i + per, len(spans)) - 1][1]
        out.append((TextChunk(text[s:e], s, e), make_block(text[s:e])))
    return out


def doc_text(i: int, version: int = 0, sentences: int = 6) -> str:
    """A document whose words are unique to (i, version): retrieval of `question(i)` is unambiguous."""
    return " ".join(
        f"Fact {j} of doc{i} says topic{i}w{j} relates to ver{version}x{i}x{j} and more{i}."
        for j in range(sentences)
    )


def question(i: int, j: int = 0) -> str:
    return f"Fact {j} of doc{i} says topic{i}w{j} relates to what"


def open_store(path: str | Path, db_url: str | None = None, **kw: Any) -> CacheStore:
    return CacheStore.open(path, db_url, canonical="tiny", fingerprint=FP, embedder=HashEmbedder(DIM), **kw)


def add(store: CacheStore, source: str, text: str) -> Any:
    return store.add_document(source, text, {"n": len(text)}, chunked(text))


def answer(store: CacheStore, q: str) -> tuple[str, int, str, str] | None:
    """The top hit and a digest of its KV block: what an engine would answer from."""
    pairs = store.retrieve(q, k=1)
    if not pairs:
        return None
    hit, block = pairs[0]
    return hit.source, hit.ord, hit.text, hashlib.sha256(block.to_bytes()).hexdigest()


def run_ops(
    path: str, db_url: str | None, ops: list[tuple[str, ...]], ready: Any = None, fault: str | None = None
) -> None:
    """Apply ("add", source, text) / ("remove", source) in order; optionally with a fault point set."""
    torch.set_num_threads(1)
    saved = os.environ.get("CAGKV_FAULT")
    if fault:
        os.environ["CAGKV_FAULT"] = fault
    store = open_store(path, db_url)
    try:
        if ready is not None:
            ready.set()
        for op in ops:
            if op[0] == "add":
                add(store, op[1], op[2])
            else:
                store.remove(op[1], missing_ok=True)
    finally:
        store.close()
        if saved is None:
            os.environ.pop("CAGKV_FAULT", None)
        else:
            os.environ["CAGKV_FAULT"] = saved


def forkserver() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    ctx.set_forkserver_preload(["torch", "faiss", "sqlalchemy", "cagkv.kv", "cagkv.stores", "storekit"])
    return ctx


def wait_all(procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            raise AssertionError(f"worker {p.name} did not finish within {timeout} s")


# ---------------------------------------------------------------------------- PostgreSQL
def pg_admin_url() -> str:
    """`$CAGKV_TEST_PG_URL` (set by `source scripts/pg.sh && pg_start`), else skip (fail in CI)."""
    import pytest

    url = os.environ.get("CAGKV_TEST_PG_URL")
    if not url:
        reason = "no PostgreSQL: CAGKV_TEST_PG_URL is unset (start one with `source scripts/pg.sh && pg_start`)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " -- required in CI")
        pytest.skip(reason)
    return url


@contextmanager
def pg_database(admin_url: str) -> Iterator[str]:
    """A fresh database on the test server for one test; dropped afterwards."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"cagkv_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
