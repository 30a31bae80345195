"""Crash consistency: an ingest process killed at 20+ points never leaves a broken store.

Each case: a store with documents 0-2; a worker process then adds documents, replaces
document 0, removes document 1 and adds more; it dies at an injected fault point
(`CAGKV_FAULT=<point>` -> `os._exit`, i.e. no cleanup, like kill -9) or is SIGKILLed after
a random delay. Afterwards:
  1. the store opens, and every chunk row's blob loads (no chunk points to a missing or
     wrong blob) before any repair;
  2. every question gets the answer of one state the ops pass through (each write is
     atomic, so the store is in the state after some prefix of the ops), in particular
     questions answerable before the crash about untouched documents are answered the same;
  3. `doctor` reports only repairable debris (orphan blobs, temp files, a stale index) and
     `doctor(repair=True)` makes it consistent;
  4. re-running the ingest completes and the store then answers exactly like a store that
     never crashed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from cagkv.stores.catalog import Chunk
from cagkv.stores.durability import FAULT_POINTS, FaultInjected
from sqlalchemy import select
from storekit import add, answer, doc_text, forkserver, open_store, question, run_ops

BASE = [("add", f"doc{i}.txt", doc_text(i)) for i in range(3)]
OPS = [
    ("add", "doc3.txt", doc_text(3)),
    ("add", "doc0.txt", doc_text(0, version=1)),
    ("remove", "doc1.txt"),
    ("add", "doc4.txt", doc_text(4)),
    ("add", "doc5.txt", doc_text(5)),
    ("add", "doc6.txt", doc_text(6)),
]
QUESTIONS = {i: [question(i, 3)] for i in range(7)}
REPAIRABLE = {"orphan_blob", "temp_file", "index"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Answers in every state the ops pass through (after each prefix), from a store that never crashes."""
    path = tmp_path_factory.mktemp("ref") / "store"
    s = open_store(path)
    for _, src, text in BASE:
        add(s, src, text)
    states = [_answers(s)]
    for op in OPS:
        run_ops(str(path), None, [op])
        states.append(_answers(s))
    timing = str(tmp_path_factory.mktemp("timing") / "store")
    run_ops(timing, None, BASE)
    t0 = time.perf_counter()
    run_ops(timing, None, OPS)
    duration = time.perf_counter() - t0
    assert states[-1][0] != states[0][0] and states[-1][1] != states[0][1]  # the ops do change these
    return {"states": states, "before": states[0], "after": states[-1], "duration": duration}


def _answers(s) -> dict:
    return {i: [answer(s, q) for q in qs] for i, qs in QUESTIONS.items()}


def _base_store(path: Path) -> None:
    s = open_store(path)
    for _, src, text in BASE:
        add(s, src, text)
    s.close()


def _check_after_crash(path: Path, reference: dict) -> list[str]:
    s = open_store(path, create=False)
    # 1. every chunk that a reader can see has its blob, intact
    with s.catalog.read() as sess:
        ids = list(sess.scalars(select(Chunk.id)))
    assert len(s.load_blocks(ids)) == len(ids)
    # 2. answers: exactly those of one state the ops pass through
    got = _answers(s)
    assert got in reference["states"], "answers match no committed state of the ops"
    # 3. doctor: only repairable debris, then clean
    report = s.doctor()
    kinds = sorted({p.kind for p in report.problems})
    assert set(kinds) <= REPAIRABLE, report.problems
    if not report.ok:
        s.doctor(repair=True)
        assert s.doctor().ok
    # 4. re-running the ingest completes and answers like a store that never crashed
    s.close()
    run_ops(str(path), None, OPS)
    s = open_store(path)
    assert s.doctor().ok
    assert _answers(s) == reference["after"], "answers differ from a store that never crashed"
    s.close()
    return kinds


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_killed_at_fault_point(point: str, tmp_path: Path, reference: dict):
    path = tmp_path / "store"
    _base_store(path)
    p = forkserver().Process(target=run_ops, args=(str(path), None, OPS, None, f"{point}:exit"))
    p.start()
    p.join(60)
    assert p.exitcode == 137, f"the fault at {point} did not fire (exit {p.exitcode})"
    print(f"\n[crash] exit at {point}: doctor found {_check_after_crash(path, reference) or 'nothing'}")


@pytest.mark.parametrize("point", ["after_blobs", "before_commit", "after_commit", "before_index_save"])
def test_exception_at_fault_point(point: str, tmp_path: Path, reference: dict):
    """An exception (not a kill) mid-write: the same guarantees, in the same process."""
    path = tmp_path / "store"
    _base_store(path)
    with pytest.raises(FaultInjected):
        run_ops(str(path), None, OPS, None, f"{point}:raise")
    print(f"\n[crash] raise at {point}: doctor found {_check_after_crash(path, reference) or 'nothing'}")


@pytest.mark.parametrize("seed", range(10))
def test_sigkill_after_random_delay(seed: int, tmp_path: Path, reference: dict):
    path = tmp_path / "store"
    _base_store(path)
    ctx = forkserver()
    ready = ctx.Event()
    p = ctx.Process(target=run_ops, args=(str(path), None, OPS, ready, None))
    p.start()
    assert ready.wait(60)
    time.sleep(random.Random(seed).uniform(0.0, reference["duration"] * 0.9))
    alive = p.is_alive()
    p.kill()  # SIGKILL
    p.join(10)
    kinds = _check_after_crash(path, reference)
    when = "mid-run" if alive else "after the end"
    print(f"\n[crash] SIGKILL seed {seed} ({when}): doctor found {kinds or 'nothing'}")
