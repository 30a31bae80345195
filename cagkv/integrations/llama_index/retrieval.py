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

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

try:
    from llama_index.core.base.base_query_engine import BaseQueryEngine
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseGen,
        LLMMetadata,
    )
    from llama_index.core.base.response.schema import (
        RESPONSE_TYPE,
        AsyncStreamingResponse,
        Response,
        StreamingResponse,
    )
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.schema import (
        BaseNode,
        Document,
        ImageDocument,
        ImageNode,
        MetadataMode,
        NodeRelationship,
        NodeWithScore,
        QueryBundle,
        RelatedNodeInfo,
        TextNode,
        TransformComponent,
    )
    from llama_index.core.vector_stores.types import (
        FilterCondition,
        FilterOperator,
        MetadataFilter,
        MetadataFilters,
    )
except ImportError as exc:  # pragma: no cover - llama-index-core is a declared dependency
    raise ImportError(
        "cagkv.integrations.llama_index needs llama-index-core: "
        "pip install 'llama-index-core>=0.12,<0.15'"
    ) from exc

from cagkv.errors import UsageError

if TYPE_CHECKING:
    from cagkv.pipeline import CAG, Answer
    from cagkv.stores import CacheStore

__all__ = [
    "CagkvEmbedding",
    "CagkvLLM",
    "CagkvQueryEngine",
    "CagkvRetriever",
    "CagkvWriter",
    "ingest_documents",
    "matching_document_ids",
]

# Keys cagkv adds to every node's metadata (excluded from what the LLM / embedder sees).
CHUNK_ID = "cagkv_chunk_id"
DOCUMENT_ID = "cagkv_document_id"
SOURCE = "cagkv_source"
REF_DOC_ID = "ref_doc_id"  # the LlamaIndex document id a cagkv document came from
NODE_IDS = "llama_index_node_ids"  # per-chunk LlamaIndex node ids, in chunk order
_HIDDEN_KEYS = [CHUNK_ID, DOCUMENT_ID, SOURCE, REF_DOC_ID, NODE_IDS]


# --- ingestion ------------------------------------------------------------------------
def ingest_documents(
    store: "CacheStore",
    documents: Sequence[BaseNode],
    *,
    chunk_tokens: int = 256,
    batch_size: int = 8,
    dtype: str = "bfloat16",
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
        chunk_tokens, batch_size, dtype: as for `cagkv.ingest.ingest_text`.
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
            chunk_tokens=chunk_tokens, batch_size=batch_size, dtype=dtype,
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
    _store: Any = PrivateAttr()

    def __init__(self, store: "CacheStore", **kwargs: Any) -> None:
        super().__init__(store_path=str(store.path), **kwargs)
        self._store = store

    @classmethod
    def class_name(cls) -> str:
        return "CagkvWriter"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        groups = _group_by_document(nodes)
        doc_ids = ingest_documents(self._store, nodes, chunk_tokens=self.chunk_tokens)
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


def _hide(node: BaseNode) -> None:
    """Keep cagkv's bookkeeping keys out of the text LLMs and embedders see."""
    for keys in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        keys.extend(k for k in _HIDDEN_KEYS if k not in keys)


# --- metadata filters (answered from the catalog's document rows) ---------------------
def matching_document_ids(store: "CacheStore", filters: MetadataFilters | None) -> list[int] | None:
    """Ids of the store's documents whose metadata satisfy `filters` (None: no filter).

    Filters see a document's metadata plus `source` and `document_id`. Every
    `FilterOperator` is supported; conditions AND, OR and NOT nest.
    """
    if filters is None or not filters.filters:
        return None
    return [doc.id for doc in store.list_documents() if _match_all(_document_fields(doc), filters)]


def _document_fields(doc: Any) -> dict[str, Any]:
    fields = dict(doc.metadata or {})
    fields.setdefault("source", doc.source)
    fields.setdefault("document_id", doc.id)
    return fields


def _match_all(meta: dict[str, Any], filters: MetadataFilters) -> bool:
    """LlamaIndex's own semantics (`vector_stores.utils.build_metadata_filter_fn`), nested."""
    results = [
        _match_all(meta, f) if isinstance(f, MetadataFilters) else _match_one(meta, f)
        for f in filters.filters
    ]
    match filters.condition or FilterCondition.AND:
        case FilterCondition.AND:
            return all(results)
        case FilterCondition.OR:
            return any(results)
        case FilterCondition.NOT:  # none of the filters matches
            return not any(results)
    raise NotImplementedError(f"expected filter condition and/or/not, got {filters.condition!r}")


def _match_one(meta: dict[str, Any], f: MetadataFilter) -> bool:
    op, want, got = f.operator, f.value, meta.get(f.key)
    if op == FilterOperator.IS_EMPTY:
        return got is None or got == [] or got == ""
    if got is None:
        return op in (FilterOperator.NE, FilterOperator.NIN)
    try:
        match op:
            case FilterOperator.EQ:
                return bool(got == want)
            case FilterOperator.NE:
                return bool(got != want)
            case FilterOperator.GT:
                return bool(got > want)
            case FilterOperator.LT:
                return bool(got < want)
            case FilterOperator.GTE:
                return bool(got >= want)
            case FilterOperator.LTE:
                return bool(got <= want)
            case FilterOperator.IN:
                return got in want
            case FilterOperator.NIN:
                return got not in want
            case FilterOperator.CONTAINS:
                return want in got
            case FilterOperator.ANY:
                return any(v in got for v in want)
            case FilterOperator.ALL:
                return all(v in got for v in want)
            case FilterOperator.TEXT_MATCH:
                return isinstance(got, str) and isinstance(want, str) and want in got
            case FilterOperator.TEXT_MATCH_INSENSITIVE:
                return isinstance(got, str) and isinstance(want, str) and want.lower() in got.lower()
    except TypeError:  # e.g. "a" > 3 or 3 in 5: a mismatched type never matches
        return False
    raise NotImplementedError(f"filter operator {op!r} is not supported by cagkv")


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


# --- LLM ------------------------------------------------------------------------------
class CagkvLLM(CustomLLM):
    """A cagkv target model as a LlamaIndex LLM (local, greedy, text only).

    `complete` / `stream_complete` continue the prompt as given; `chat` / `stream_chat`
    render the messages with the model's chat template when it has one. Set
    `Settings.llm = CagkvLLM(model="smollm2-135m")` to keep every LlamaIndex component
    on the same local models as the cache.

    Example:
        >>> llm = CagkvLLM(model="smollm2-135m", max_new_tokens=32)
        >>> print(llm.complete("The capital of France is"))
    """

    model: str = Field(description="cagkv zoo name or local folder of the model.")
    max_new_tokens: int = Field(default=256, gt=0, description="Tokens generated at most.")
    context_window: int = Field(default=2048, gt=0, description="Prompt + answer tokens.")
    _loaded: Any = PrivateAttr()

    def __init__(self, model: str, loaded: Any = None, **kwargs: Any) -> None:
        """`loaded`: an already loaded `cagkv.models.LoadedModel` (skips `cagkv.models.load`)."""
        super().__init__(model=model, **kwargs)
        if loaded is None:
            from cagkv.models import load

            loaded = load(model)
        self._loaded = loaded

    @classmethod
    def class_name(cls) -> str:
        return "CagkvLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._has_chat_template(),
            model_name=self.model,
        )

    def _has_chat_template(self) -> bool:
        return bool(getattr(self._loaded.tokenizer, "chat_template", None))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text = "".join(self._pieces(self._prompt_ids(prompt, formatted), **kwargs))
        return CompletionResponse(text=text)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        ids = self._prompt_ids(prompt, formatted)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in self._pieces(ids, **kwargs):
                text += piece
                yield CompletionResponse(text=text, delta=piece)

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if not self._has_chat_template():
            return super().chat(messages, **kwargs)
        text = "".join(self._pieces(self._chat_ids(messages), **kwargs))
        return ChatResponse(message=ChatMessage(role="assistant", content=text))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        if not self._has_chat_template():
            return super().stream_chat(messages, **kwargs)
        ids = self._chat_ids(messages)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in self._pieces(ids, **kwargs):
                text += piece
                yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta=piece)

        return gen()

    def _prompt_ids(self, prompt: str, formatted: bool) -> list[int]:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return list(self._loaded.tokenizer(prompt)["input_ids"])  # adds BOS where the model wants it

    def _chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        turns = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        rendered = self._loaded.tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=True
        )
        return list(self._loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def _pieces(self, prompt_ids: list[int], max_new_tokens: int | None = None, **_: Any) -> Iterator[str]:
        from cagkv.pipeline import generate_text

        limit = max_new_tokens or self.max_new_tokens
        if len(prompt_ids) + limit > self.context_window:
            raise UsageError(
                f"prompt of {len(prompt_ids)} tokens + {limit} new exceeds context_window "
                f"{self.context_window}"
            )
        return generate_text(self._loaded, prompt_ids, max_new_tokens=limit)


# --- embeddings -----------------------------------------------------------------------
class CagkvEmbedding(BaseEmbedding):
    """cagkv's sentence embedder (MiniLM-L6 by default) as a LlamaIndex embedding model.

    Offline: it loads the local model cagkv uses for its FAISS index, so
    `Settings.embed_model = CagkvEmbedding()` embeds exactly like the store.

    Example:
        >>> Settings.embed_model = CagkvEmbedding()
        >>> len(Settings.embed_model.get_query_embedding("hello"))
        384
    """

    model_name: str = Field(default="minilm-l6", description="cagkv embedder name or folder.")
    _embedder: Any = PrivateAttr()

    def __init__(self, model_name: str = "minilm-l6", embedder: Any = None, **kwargs: Any) -> None:
        """`embedder`: a `cagkv.stores.embed.Embedder` (e.g. a store's); else `model_name`'s."""
        if embedder is None:
            from cagkv.stores.embed import make_embedder

            embedder = make_embedder(model_name)
        super().__init__(model_name=embedder.name, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "CagkvEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embeddings([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        vectors = self._embedder.embed(list(texts))  # [N, dim], L2-normalised
        return [[float(x) for x in row] for row in vectors]
