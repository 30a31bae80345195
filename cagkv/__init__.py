"""cagkv: cache-augmented generation across heterogeneous LLMs.

A canonical model prefills documents once; their KV caches are stored (SQL catalog +
FAISS + blobs) and answered from by the canonical model directly, or by another model
through a trained translator, or by that model's own prefill as the baseline.

    >>> import cagkv
    >>> cagkv.ingest_files(["examples/docs"], store="/tmp/store")      # doctest: +SKIP
    >>> cag = cagkv.CAG.open("/tmp/store")                              # doctest: +SKIP
    >>> print(cag.ask("What does pass do?", target="gemma3-270m").text)  # doctest: +SKIP

Names are imported lazily: `import cagkv` loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CAG": "cagkv.pipeline",
    "Answer": "cagkv.pipeline",
    "AnswerStream": "cagkv.pipeline",
    "Source": "cagkv.pipeline",
    "ingest_files": "cagkv.ingest",  # cagkv.ingest.ingest (the name `ingest` is the submodule)
    "ingest_text": "cagkv.ingest",
    "IngestReport": "cagkv.ingest",
    "CacheStore": "cagkv.stores",
    "KVBlock": "cagkv.kv",
    "PromptFormat": "cagkv.prompt",
    "chunk_text": "cagkv.chunking",
    "prefill_chunks": "cagkv.prefill",
    "load": "cagkv.models",
    "CagkvError": "cagkv.errors",
    "UsageError": "cagkv.errors",
    "StoreError": "cagkv.errors",
    "TranslatorError": "cagkv.errors",
}

__all__ = [
    "CAG",
    "Answer",
    "AnswerStream",
    "CacheStore",
    "CagkvError",
    "IngestReport",
    "KVBlock",
    "PromptFormat",
    "Source",
    "StoreError",
    "TranslatorError",
    "UsageError",
    "__version__",
    "chunk_text",
    "ingest_files",
    "ingest_text",
    "load",
    "prefill_chunks",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        attr = "ingest" if name == "ingest_files" else name
        return getattr(importlib.import_module(_EXPORTS[name]), attr)
    raise AttributeError(f"module 'cagkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
