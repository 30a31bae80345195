"""cagkv.stores: where KV caches live (bytes below, tensors above).

- `catalog.py`: the SQL catalog (SQLAlchemy 2; SQLite WAL by default, any URL).
- `blobs.py`: bytes under keys, atomic writes, sha256-checked reads (folder or fsspec URL).
- `vectors.py`: the FAISS index of chunk embeddings, ids = chunk ids.
- `embed.py`: embedders (MiniLM by default; a hashing one for tests).
- `store.py`: `CacheStore`, the facade that keeps the three consistent; `records.py`: the
  values it returns (hits, documents, reports); `durability.py`: writer lock and crash hooks.
- `doctor.py`: consistency checks and repair; `checks.py`: input validation.
"""

from .blobs import BlobStore, FsspecBlobStore, LocalBlobStore, open_blob_store
from .embed import Embedder, HashEmbedder, MiniLMEmbedder, make_embedder
from .records import AddResult, ChunksChangedError, DoctorReport, DocumentInfo, Hit, Problem, content_hash
from .store import CacheStore
from .vectors import CorruptIndexError, VectorIndex

__all__ = [
    "AddResult",
    "BlobStore",
    "CacheStore",
    "ChunksChangedError",
    "CorruptIndexError",
    "DoctorReport",
    "DocumentInfo",
    "Embedder",
    "FsspecBlobStore",
    "HashEmbedder",
    "Hit",
    "LocalBlobStore",
    "MiniLMEmbedder",
    "Problem",
    "VectorIndex",
    "content_hash",
    "make_embedder",
    "open_blob_store",
]
