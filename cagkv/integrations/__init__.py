"""Integrations with other frameworks; each imports its framework only when used.

- `cagkv.integrations.llama_index`: ingestion, retriever, query engine, LLM and embedding
  classes for LlamaIndex (needs `llama-index-core`).
"""

from __future__ import annotations

import importlib
from typing import Any

_LLAMA_INDEX = (
    "CagkvEmbedding", "CagkvLLM", "CagkvQueryEngine", "CagkvRetriever", "CagkvWriter",
    "ingest_documents", "matching_document_ids",
)  # fmt: skip

__all__ = sorted(_LLAMA_INDEX)


def __getattr__(name: str) -> Any:
    if name in _LLAMA_INDEX:
        return getattr(importlib.import_module("cagkv.integrations.llama_index"), name)
    raise AttributeError(f"module 'cagkv.integrations' has no attribute {name!r}")
