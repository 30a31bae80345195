"""LlamaIndex integration: a cagkv store and engine under a LlamaIndex pipeline.

Each class is a thin shell; every LlamaIndex method calls one cagkv function.

    ingest_documents(store, docs)   LlamaIndex documents / nodes -> cagkv documents + chunks
    CagkvWriter                     the same as a TransformComponent for an IngestionPipeline
    CagkvRetriever                  BaseRetriever over CacheStore.search -> NodeWithScore
    CagkvQueryEngine                BaseQueryEngine over CAG.ask / ask_stream -> Response,
                                    StreamingResponse, AsyncStreamingResponse; a QueryEngineTool
    CagkvLLM                        CustomLLM over a cagkv target model (complete, chat, stream)
    CagkvEmbedding                  BaseEmbedding over the store's embedder (MiniLM by default)

Nothing here reaches the network: pass `llm=` / `embed_model=` (or set
`Settings.llm = CagkvLLM(...)`, `Settings.embed_model = CagkvEmbedding()`) wherever a
LlamaIndex component would otherwise resolve its OpenAI defaults.

Modules (their public names are re-exported here; import from this package):

    ingest      ingest_documents, CagkvWriter
    filters     matching_document_ids (LlamaIndex metadata filters on the catalog)
    retrieval   CagkvRetriever, CagkvQueryEngine (nodes, source nodes, responses)
    models      CagkvLLM, CagkvEmbedding
    _metadata   the metadata keys cagkv adds to nodes (CHUNK_ID, DOCUMENT_ID, ...)

Example:
    >>> from llama_index.core import SimpleDirectoryReader
    >>> from cagkv.stores import CacheStore
    >>> from cagkv.pipeline import CAG
    >>> from cagkv.integrations.llama_index import CagkvQueryEngine, ingest_documents
    >>> store = CacheStore.open("/tmp/store", canonical="smollm2-135m")
    >>> ingest_documents(store, SimpleDirectoryReader("examples/docs").load_data())
    >>> engine = CagkvQueryEngine(CAG(store), target="gemma3-270m")
    >>> response = engine.query("Who wrote the letter?")
    >>> print(response, response.source_nodes[0].node.metadata["cagkv_chunk_id"])
"""

from __future__ import annotations

try:
    import llama_index.core  # noqa: F401  (every module of this package imports from it)
except ImportError as exc:  # pragma: no cover - llama-index-core is a declared dependency
    raise ImportError(
        "cagkv.integrations.llama_index needs llama-index-core: "
        "pip install 'llama-index-core>=0.12,<0.15'"
    ) from exc

from cagkv.integrations.llama_index._metadata import (  # noqa: F401  (importable from here)
    CHUNK_ID,
    DOCUMENT_ID,
    NODE_IDS,
    REF_DOC_ID,
    SOURCE,
)
from cagkv.integrations.llama_index.filters import matching_document_ids
from cagkv.integrations.llama_index.ingest import CagkvWriter, ingest_documents
from cagkv.integrations.llama_index.models import CagkvEmbedding, CagkvLLM
from cagkv.integrations.llama_index.retrieval import CagkvQueryEngine, CagkvRetriever

__all__ = [
    "CagkvEmbedding",
    "CagkvLLM",
    "CagkvQueryEngine",
    "CagkvRetriever",
    "CagkvWriter",
    "ingest_documents",
    "matching_document_ids",
]
