"""Crash safety of store writes: the inter-process writer lock and the fault points
the crash tests kill a writer at (`CAGKV_FAULT=<point>[:exit|:raise]`)."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cagkv.errors import StoreError

FAULT_POINTS = (
    "before_blobs",
    "mid_blobs",
    "after_blobs",
    "before_commit",
    "after_commit",
    "before_index_save",
    "after_index_save",
    "mid_old_blob_delete",
    "remove_after_commit",
    "remove_before_blob_delete",
)


class FaultInjected(RuntimeError):
    """Raised by a fault point when `CAGKV_FAULT=<point>:raise` (tests only)."""


def fault(point: str) -> None:
    """Test hook: `CAGKV_FAULT=point[:exit|:raise]` kills the process (like kill -9) or raises here."""
    spec = os.environ.get("CAGKV_FAULT")
    if not spec:
        return
    name, _, action = spec.partition(":")
    if name != point:
        return
    if action == "raise":
        raise FaultInjected(f"fault injected at {point}")
    os._exit(137)


@contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    """fcntl exclusive lock on `path`, polled until `timeout` (then StoreError: busy)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StoreError(f"store {path.parent} is not writable: {e.strerror}") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreError(f"store {path.parent} is busy: another process holds its write lock") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
