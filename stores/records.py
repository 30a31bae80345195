"""The values a CacheStore hands out (hits, documents, doctor reports) and the
content-addressing helpers it keys documents and blobs by."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from cagkv.errors import StoreError

from .blobs import sha256


class ChunksChangedError(StoreError):
    """A chunk found by a search was removed by a writer before its blob was read."""


class TextChunkLike(Protocol):
    text: str
    start: int
    end: int


@dataclass
class Hit:
    chunk_id: int
    document_id: int
    score: float
    text: str
    source: str
    ord: int


@dataclass
class AddResult:
    document_id: int
    status: str  # "added" | "replaced" | "unchanged"
    chunks: int = 0
    tokens: int = 0
    nbytes: int = 0


@dataclass
class DocumentInfo:
    id: int
    source: str
    content_hash: str
    metadata: dict[str, Any]
    chunks: int
    tokens: int
    nbytes: int
    created: str
    chunking: dict[str, Any] | None = None  # None: not recorded (added before schema version 2)


@dataclass
class Problem:
    kind: str  # missing_blob | corrupt_blob | orphan_blob | temp_file | index | bad_row
    message: str
    document: str | None = None
    chunk: int | None = None


@dataclass
class DoctorReport:
    ok: bool
    checked_chunks: int
    problems: list[Problem] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked_chunks": self.checked_chunks,
            "problems": [p.__dict__ for p in self.problems],
            "repaired": self.repaired,
        }


def content_hash(text: str) -> str:
    """sha256 of the UTF-8 text: the document identity for idempotent ingest."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normal_json(value: Any) -> Any:
    """`value` as it reads back from a JSON column (tuples become lists), for comparisons."""
    return None if value is None else json.loads(json.dumps(value))


def blob_key(data: bytes) -> str:
    digest = sha256(data)
    return f"{digest[:2]}/{digest}.kv"
