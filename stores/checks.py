"""Input checks of the store: one-line typed errors for anything a caller can get wrong."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from cagkv.errors import StoreError, UsageError
from cagkv.kv import KVBlock

from .catalog import Document, source_hash

MAX_SOURCE_CHARS = 4096
MAX_METADATA_BYTES = 256 * 1024
MAX_TEXT_CHARS = 200_000_000


def doc_cond(document: int | str) -> Any:
    """The WHERE clause selecting a document by id (int) or source (str)."""
    if isinstance(document, bool) or not isinstance(document, (int, str)):
        raise UsageError(f"a document is named by its id (int) or source (str), got {document!r}")
    if isinstance(document, int):
        return Document.id == document
    check_text(document, "document source", MAX_SOURCE_CHARS)
    return Document.source_hash == source_hash(document)


def check_layout(i: int, block: KVBlock, layout: dict[str, Any] | None) -> dict[str, Any]:
    """Every block of a store has one dtype and [L, H, *, D] layout (recorded by the first)."""
    if not isinstance(block, KVBlock):
        raise UsageError(f"chunk {i}: expected a KVBlock, got {type(block).__name__}")
    mine = {
        "dtype": str(block.dtype).removeprefix("torch."),
        "layers": int(block.keys.shape[0]),
        "heads": int(block.keys.shape[1]),
        "head_dim": int(block.keys.shape[3]),
        "positions_free": bool(block.positions_free),
    }
    if layout is not None and mine != layout:
        raise StoreError(f"chunk {i}: KV layout {mine} differs from the store's {layout}")
    return mine


def as_ids(values: Iterable[Any]) -> list[int]:
    """Ids given as ints or digit strings (LlamaIndex passes strings) -> ints."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise UsageError(f"ids must be integers, got {list(values)[:5]!r}") from None


def check_text(s: Any, what: str, limit: int) -> None:
    if not isinstance(s, str):
        raise UsageError(f"{what} must be a string, got {type(s).__name__}")
    if len(s) > limit:
        raise UsageError(f"{what} is too long ({len(s)} characters, limit {limit})")
    if "\x00" in s:
        raise UsageError(f"{what} contains a NUL character")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} is not valid Unicode (lone surrogates)") from None


def check_json(value: Any, what: str) -> None:
    try:
        raw = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{what} must be JSON-serialisable: {e}") from None
    except RecursionError:
        raise UsageError(f"{what} is nested too deeply") from None
    check_text(raw, what, MAX_METADATA_BYTES)
    if len(raw.encode("utf-8")) > MAX_METADATA_BYTES:
        raise UsageError(f"{what} is too large ({len(raw.encode())} bytes, limit {MAX_METADATA_BYTES})")
