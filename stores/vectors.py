"""FAISS index of chunk embeddings: `IndexIDMap2(IndexFlatIP)`, ids = chunk ids.

Inner product over L2-normalised embeddings = cosine similarity. The index is persisted
as one safetensors file (`vectors.safetensors`: the serialised FAISS bytes as a uint8
tensor, plus the store id and catalog generation it reflects and a sha256), written to a temporary
name, fsynced and renamed. The checksum is verified before FAISS parses the bytes.
The catalog holds every embedding too, so the index can always be rebuilt from it.

Example:
    >>> index = VectorIndex(dim=384)
    >>> index.add(np.array([7, 8]), vecs)               # vecs [2, 384] float32
    >>> index.search(query, k=1, allowed_ids={8})       # [(8, 0.93)]
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from cagkv.errors import StoreError

FORMAT = "cagkv.vectors"
FORMAT_VERSION = "1"


class CorruptIndexError(StoreError):
    """A persisted index that is missing, truncated or does not match its checksum."""


_FAISS: Any = None


def _faiss() -> Any:
    global _FAISS
    if _FAISS is None:
        try:
            import faiss
        except ImportError:  # pragma: no cover - faiss-cpu is a dependency
            raise StoreError("faiss is not installed: pip install faiss-cpu") from None
        # One query at a time over a flat index: OpenMP threads only add spin-up cost
        # (17 ms a search instead of 0.1 ms on a busy 2-core machine).
        faiss.omp_set_num_threads(int(os.environ.get("CAGKV_FAISS_THREADS", "1")))
        _FAISS = faiss
    return _FAISS


class VectorIndex:
    """A flat inner-product index whose ids are chunk ids."""

    def __init__(self, dim: int, generation: int = -1, store_id: str = "") -> None:
        faiss = _faiss()
        self.dim = int(dim)
        self.generation = generation
        self.store_id = store_id
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def ids(self) -> np.ndarray:
        """All ids in the index, int64 [N]."""
        return _faiss().vector_to_array(self.index.id_map).astype(np.int64)

    def add(self, ids: Iterable[int] | np.ndarray, vecs: np.ndarray) -> None:
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
        vecs = np.ascontiguousarray(np.asarray(vecs, dtype=np.float32).reshape(len(ids), self.dim))  # [N, dim]
        if len(ids):
            self.index.add_with_ids(vecs, ids)

    def remove(self, ids: Iterable[int] | np.ndarray) -> int:
        ids = np.ascontiguousarray(np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64))
        if not len(ids):
            return 0
        return int(self.index.remove_ids(_faiss().IDSelectorBatch(ids)))

    def search(
        self, query: np.ndarray, k: int, allowed_ids: Iterable[int] | None = None
    ) -> list[tuple[int, float]]:
        """Top-k (id, score) for one query vector [dim], best first, restricted to `allowed_ids`."""
        faiss = _faiss()
        q = np.ascontiguousarray(np.asarray(query, dtype=np.float32).reshape(1, self.dim))  # [1, dim]
        k = min(int(k), self.ntotal)
        if k <= 0:
            return []
        params = None
        if allowed_ids is not None:
            allowed = np.ascontiguousarray(np.fromiter(allowed_ids, dtype=np.int64))
            if not len(allowed):
                return []
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(allowed))
        scores, ids = self.index.search(q, k, params=params)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    # ------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike[str], generation: int | None = None) -> None:
        """Write atomically (temp + fsync + rename) with the catalog generation it reflects."""
        from safetensors.numpy import save

        if generation is not None:
            self.generation = generation
        raw = _faiss().serialize_index(self.index)  # uint8 [nbytes]
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "generation": str(self.generation),
            "store_id": self.store_id,
            "dim": str(self.dim),
            "sha256": hashlib.sha256(raw.tobytes()).hexdigest(),
        }
        # one metadata entry of sorted JSON: safetensors does not fix the order of several
        data = save({"faiss": raw}, metadata={"cagkv": json.dumps(meta, sort_keys=True)})
        path = Path(path)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> VectorIndex:
        """Read an index written by `save`; raise CorruptIndexError when it is unusable."""
        from safetensors.numpy import load

        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CorruptIndexError(f"vector index {path} is missing") from None
        try:
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["cagkv"])
            tensors = load(data)
            raw = tensors["faiss"]
        except Exception:
            raise CorruptIndexError(f"vector index {path} is unreadable") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise CorruptIndexError(f"vector index {path} has an unknown format")
        if raw.dtype != np.uint8 or hashlib.sha256(raw.tobytes()).hexdigest() != meta.get("sha256"):
            raise CorruptIndexError(f"vector index {path} does not match its checksum")
        index = _faiss().deserialize_index(np.ascontiguousarray(raw))
        out = cls.__new__(cls)
        out.dim = int(meta["dim"])
        out.generation = int(meta["generation"])
        out.store_id = str(meta.get("store_id", ""))
        out.index = index
        if index.d != out.dim or not hasattr(index, "id_map"):
            raise CorruptIndexError(f"vector index {path} is not an id-mapped index of dim {out.dim}")
        return out

    @staticmethod
    def read_stamp(path: str | os.PathLike[str]) -> tuple[str, int] | None:
        """(store_id, generation) of a persisted index, from its header only; None when unreadable."""
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n < 1_000_000:
                    return None
                meta = json.loads(json.loads(f.read(n))["__metadata__"]["cagkv"])
                return str(meta.get("store_id", "")), int(meta["generation"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    @classmethod
    def build(
        cls, dim: int, ids: np.ndarray, vecs: np.ndarray, generation: int = -1, store_id: str = ""
    ) -> VectorIndex:
        out = cls(dim, generation, store_id)
        out.add(ids, vecs)
        return out
