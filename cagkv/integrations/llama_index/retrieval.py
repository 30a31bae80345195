"""Retrieval and answering: CacheStore.search and CAG.ask as LlamaIndex nodes and responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.schema import (
    NodeRelationship,
    NodeWithScore,
    QueryBundle,
    RelatedNodeInfo,
    TextNode,
)
from llama_index.core.vector_stores.types import MetadataFilters

from cagkv.integrations.llama_index._metadata import (
    CHUNK_ID,
    DOCUMENT_ID,
    NODE_IDS,
    REF_DOC_ID,
    SOURCE,
    _hide,
)
from cagkv.integrations.llama_index.filters import matching_document_ids

if TYPE_CHECKING:
    from cagkv.pipeline import CAG, Answer
    from cagkv.stores import CacheStore


# --- retrieval ------------------------------------------------------------------------
class CagkvRetriever(BaseRetriever):
    """Chunks of a cagkv store as LlamaIndex nodes, ranked by `CacheStore.search`.

    Each `NodeWithScore` holds a `TextNode` with the chunk text, its document's metadata
    plus `cagkv_chunk_id`, `cagkv_document_id` and `cagkv_source`, and a SOURCE relation
    to the LlamaIndex document it was ingested from. Node ids are the original LlamaIndex
    node ids for chunks ingested as nodes, else `cagkv-chunk-<chunk id>`.

    Example:
        >>> retriever = CagkvRetriever(store, similarity_top_k=3,
        ...     filters=MetadataFilters(filters=[MetadataFilter(key="lang", value="en")]))
        >>> for hit in retriever.retrieve("Who wrote the letter?"): print(hit.score, hit.text)
    """

    def __init__(
        self,
        store: "CacheStore",
        similarity_top_k: int = 3,
        filters: MetadataFilters | None = None,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
    ) -> None:
        self._store = store
        self._top_k = similarity_top_k
        self._filters = filters
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        document_ids = matching_document_ids(self._store, self._filters)
        if document_ids == []:
            return []
        # A query embedding given by the caller (same embedder as the store) is used as is.
        query = query_bundle.query_str if query_bundle.embedding is None else query_bundle.embedding
        hits = self._store.search(query, k=self._top_k, document_ids=document_ids)
        documents = _documents_by_id(self._store)
        return [_to_node(h.chunk_id, h.document_id, h.ord, h.score, h.text, documents) for h in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def _documents_by_id(store: "CacheStore") -> dict[str, Any]:
    return {str(doc.id): doc for doc in store.list_documents()}


def _to_node(
    chunk_id: Any, document_id: Any, order: int, score: float, text: str, documents: dict[str, Any]
) -> NodeWithScore:
    """One retrieved cagkv chunk as a LlamaIndex node (ids and metadata mapped back)."""
    doc = documents.get(str(document_id))
    doc_meta = dict(doc.metadata) if doc is not None else {}
    node_ids = doc_meta.pop(NODE_IDS, None) or []
    node_id = node_ids[order] if 0 <= order < len(node_ids) else f"cagkv-chunk-{chunk_id}"
    metadata = {
        **doc_meta,
        CHUNK_ID: str(chunk_id),
        DOCUMENT_ID: str(document_id),
        SOURCE: doc.source if doc is not None else None,
    }
    ref_doc_id = str(doc_meta.get(REF_DOC_ID, f"cagkv-document-{document_id}"))
    node = TextNode(
        id_=node_id,
        text=text,
        metadata=metadata,
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=ref_doc_id)},
    )
    _hide(node)
    return NodeWithScore(node=node, score=float(score))


# --- query engine ---------------------------------------------------------------------
class CagkvQueryEngine(BaseQueryEngine):
    """Answers from stored caches: `CAG.ask` behind LlamaIndex's query-engine interface.

    `query` returns a `Response` (a `StreamingResponse` with `streaming=True`; `aquery`
    then returns an `AsyncStreamingResponse`) whose `source_nodes` are the chunks cagkv
    answered from (as `CagkvRetriever` gives them) and whose `metadata` holds cagkv's
    `target`, `mode` (the mode that ran), `mode_reason`, `timings_ms` and `tokens`. A
    streaming response fills `source_nodes` and `metadata` in when its stream ends.
    Wrap it in `QueryEngineTool.from_defaults(engine, name=..., description=...)` for agents.

    Args:
        cag: a `cagkv.pipeline.CAG` bound to a store.
        target, mode, top_k, max_new_tokens, replay: passed to `CAG.ask` unchanged.
        filters: LlamaIndex metadata filters on documents (see `matching_document_ids`).
        streaming: return streaming responses.

    Example:
        >>> engine = CagkvQueryEngine(CAG(store), target="gemma3-270m", mode="auto")
        >>> response = engine.query("Who wrote the letter?")
        >>> response.metadata["timings_ms"]["first_token"], response.source_nodes[0].score
    """

    def __init__(
        self,
        cag: "CAG",
        target: str | None = None,
        mode: str = "auto",
        top_k: int = 3,
        max_new_tokens: int = 64,
        replay: int | None = None,
        filters: MetadataFilters | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        self._cag = cag
        self._ask_kwargs: dict[str, Any] = dict(
            target=target, mode=mode, top_k=top_k, max_new_tokens=max_new_tokens, replay=replay
        )
        self._filters = filters
        self._streaming = streaming
        super().__init__(callback_manager=callback_manager)

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {}

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """The chunks `query` would answer from (cagkv retrieval, same top_k and filters)."""
        retriever = CagkvRetriever(
            self._cag.store,
            similarity_top_k=self._ask_kwargs["top_k"],
            filters=self._filters,
            callback_manager=self.callback_manager,
        )
        return retriever.retrieve(query_bundle)

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        question = query_bundle.query_str
        with self.callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: question}
        ) as event:
            if self._streaming:
                response: RESPONSE_TYPE = self._stream(question)
            else:
                response = self._response(self._cag.ask(question, **self._kwargs()))
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        if not self._streaming:
            return await asyncio.to_thread(self._query, query_bundle)
        stream = self._stream(query_bundle.query_str)
        return AsyncStreamingResponse(
            response_gen=_aiter_in_thread(stream.response_gen),
            source_nodes=stream.source_nodes,
            metadata=stream.metadata,
        )

    def _kwargs(self) -> dict[str, Any]:
        """`CAG.ask` arguments, with the documents the filters allow (read per query)."""
        return {**self._ask_kwargs, "document_ids": matching_document_ids(self._cag.store, self._filters)}

    def _stream(self, question: str) -> StreamingResponse:
        """A StreamingResponse whose sources and metadata fill in when the stream ends."""
        source_nodes: list[NodeWithScore] = []
        metadata: dict[str, Any] = {}
        kwargs = self._kwargs()

        def pieces() -> Iterator[str]:
            answer = yield from self._cag.ask_stream(question, **kwargs)
            done = self._response(answer)
            source_nodes.extend(done.source_nodes)
            metadata.update(done.metadata or {})

        return StreamingResponse(response_gen=pieces(), source_nodes=source_nodes, metadata=metadata)

    def _response(self, answer: "Answer") -> Response:
        metadata = {
            "target": answer.target,
            "mode": answer.mode,
            "mode_reason": getattr(answer, "mode_reason", ""),
            "timings_ms": dict(answer.timings_ms),
            "tokens": dict(answer.tokens),
        }
        nodes = _source_nodes(self._cag.store, answer.sources)
        return Response(response=answer.text, source_nodes=nodes, metadata=metadata)


def _source_nodes(store: "CacheStore", sources: Sequence[Any]) -> list[NodeWithScore]:
    """An Answer's sources as nodes; chunk order is looked up where node ids need it."""
    documents = _documents_by_id(store)
    order: dict[str, int] = {}
    for doc_id in {s.document for s in sources}:
        if NODE_IDS in getattr(documents.get(doc_id), "metadata", {}):
            order.update({str(h.chunk_id): h.ord for h in store.chunks_of(int(doc_id))})
    return [
        _to_node(s.chunk, s.document, order.get(s.chunk, -1), s.score, s.text, documents)
        for s in sources
    ]


async def _aiter_in_thread(pieces: Iterator[str]) -> AsyncIterator[str]:
    """Drive a blocking generator from a worker thread, one piece at a time."""
    done = object()
    while True:
        piece = await asyncio.to_thread(next, pieces, done)
        if piece is done:
            return
        yield piece  # type: ignore[misc]
