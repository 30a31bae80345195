"""LlamaIndex documents / nodes -> cagkv documents + chunks (function and pipeline step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import (
    BaseNode,
    Document,
    ImageDocument,
    ImageNode,
    MetadataMode,
    TextNode,
    TransformComponent,
)

from cagkv.errors import UsageError
from cagkv.integrations.llama_index._metadata import (
    _HIDDEN_KEYS,
    DOCUMENT_ID,
    NODE_IDS,
    REF_DOC_ID,
    _hide,
)

if TYPE_CHECKING:
    from cagkv.stores import CacheStore


def ingest_documents(
    store: "CacheStore",
    documents: Sequence[BaseNode],
    *,
    chunk_tokens: int = 256,
    batch_size: int = 8,
    dtype: str = "bfloat16",
    device: str | None = None,
) -> list[int]:
    """Put LlamaIndex documents or nodes into a cagkv store; returns cagkv document ids.

    A `Document` becomes one cagkv document, chunked by cagkv (at most `chunk_tokens`
    canonical-model tokens, sentence boundaries). Nodes from a node parser keep their
    boundaries: the nodes of one source document (same `ref_doc_id`) become one cagkv
    document whose chunks are exactly those nodes, and retrieval gives back their node
    ids. The cagkv document keeps the (first node's) metadata plus the LlamaIndex id as
    `ref_doc_id`; its source is the `file_path` (or `source`, `url`) metadata, else
    `llama_index:<ref_doc_id>`. Idempotent: an unchanged document is not prefilled again.

    Args:
        store: an open `cagkv.stores.CacheStore` (its canonical model prefills).
        documents: `Document`s and/or `TextNode`s (image and other non-text nodes are refused).
        chunk_tokens, batch_size, dtype, device: as for `cagkv.ingest.ingest_text` (device:
            where the canonical model prefills, e.g. "cuda"; default the CPU).
    """
    from cagkv.ingest import ingest_text

    ids: list[int] = []
    seen: dict[str, int] = {}
    for key, group in _group_by_document(documents).items():
        first = group[0]
        metadata = {k: v for k, v in first.metadata.items() if k not in _HIDDEN_KEYS}
        metadata[REF_DOC_ID] = key
        chunks = None
        if not (isinstance(first, Document) and len(group) == 1):
            chunks = [n.get_content(MetadataMode.NONE) for n in group]
            metadata[NODE_IDS] = [n.node_id for n in group]
        text = first.get_content(MetadataMode.NONE) if chunks is None else "\n\n".join(chunks)
        source = _source_of(first, key)
        seen[source] = seen.get(source, 0) + 1
        if seen[source] > 1:  # several documents from one file (e.g. pages): keep them apart
            source = f"{source}#{seen[source]}"
        result = ingest_text(
            store, text, source, metadata=metadata, chunks=chunks,
            chunk_tokens=chunk_tokens, batch_size=batch_size, dtype=dtype, device=device,
        )  # fmt: skip
        ids.append(int(result.document_id))
    return ids


class CagkvWriter(TransformComponent):
    """An `IngestionPipeline` step that writes the nodes it sees into a cagkv store.

    It returns the nodes unchanged except for `cagkv_document_id` in their metadata, so
    it can sit last (after a node parser) or before further transformations.

    Example:
        >>> pipeline = IngestionPipeline(
        ...     transformations=[SentenceSplitter(chunk_size=256), CagkvWriter(store=store)])
        >>> nodes = pipeline.run(documents=SimpleDirectoryReader("docs").load_data())
    """

    # Plain fields, so that IngestionPipeline's cache hash tells stores and settings apart.
    store_path: str = Field(default="", description="Path of the cagkv store written to.")
    chunk_tokens: int = Field(default=256, gt=0, description="cagkv chunk size for Documents.")
    device: str = Field(default="cpu", description='Where the canonical model prefills ("cpu", "cuda", "cuda:1").')
    _store: Any = PrivateAttr()

    def __init__(self, store: "CacheStore", **kwargs: Any) -> None:
        super().__init__(store_path=str(store.path), **kwargs)
        self._store = store

    @classmethod
    def class_name(cls) -> str:
        return "CagkvWriter"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        groups = _group_by_document(nodes)
        doc_ids = ingest_documents(self._store, nodes, chunk_tokens=self.chunk_tokens, device=self.device)
        for group, doc_id in zip(groups.values(), doc_ids, strict=True):
            for node in group:
                node.metadata[DOCUMENT_ID] = str(doc_id)
                _hide(node)
        return nodes


def _group_by_document(nodes: Sequence[BaseNode]) -> dict[str, list[BaseNode]]:
    """Nodes grouped by source document id, in first-seen order; a Document is its own."""
    groups: dict[str, list[BaseNode]] = {}
    for node in nodes:
        if not isinstance(node, (Document, TextNode)) or isinstance(node, (ImageDocument, ImageNode)):
            raise UsageError(f"expected text documents or nodes, got {type(node).__name__}")
        key = node.node_id if isinstance(node, Document) else (node.ref_doc_id or node.node_id)
        groups.setdefault(key, []).append(node)
    return groups


def _source_of(node: BaseNode, ref_doc_id: str) -> str:
    meta = node.metadata
    found = meta.get("file_path") or meta.get("source") or meta.get("url")
    return str(found) if found else f"llama_index:{ref_doc_id}"
