"""Metadata keys cagkv adds to LlamaIndex nodes, and hiding them from LLMs and embedders."""

from __future__ import annotations

from llama_index.core.schema import BaseNode

# Keys cagkv adds to every node's metadata (excluded from what the LLM / embedder sees).
CHUNK_ID = "cagkv_chunk_id"
DOCUMENT_ID = "cagkv_document_id"
SOURCE = "cagkv_source"
REF_DOC_ID = "ref_doc_id"  # the LlamaIndex document id a cagkv document came from
NODE_IDS = "llama_index_node_ids"  # per-chunk LlamaIndex node ids, in chunk order
_HIDDEN_KEYS = [CHUNK_ID, DOCUMENT_ID, SOURCE, REF_DOC_ID, NODE_IDS]


def _hide(node: BaseNode) -> None:
    """Keep cagkv's bookkeeping keys out of the text LLMs and embedders see."""
    for keys in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        keys.extend(k for k in _HIDDEN_KEYS if k not in keys)
