"""LlamaIndex integration against the real llama-index-core, tiny random models, a hash embedder.

Every answer is compared with what cagkv itself returns for the same question and mode.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.base.response.schema import (  # noqa: E402
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import NodeRelationship, TextNode  # noqa: E402
from llama_index.core.tools import QueryEngineTool  # noqa: E402
from llama_index.core.vector_stores.types import (  # noqa: E402
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)

from cagkv.errors import UsageError  # noqa: E402
from cagkv.integrations.llama_index import (  # noqa: E402
    CHUNK_ID,
    DOCUMENT_ID,
    CagkvEmbedding,
    CagkvLLM,
    CagkvQueryEngine,
    CagkvRetriever,
    CagkvWriter,
    ingest_documents,
    matching_document_ids,
)
from cagkv.models import load  # noqa: E402
from cagkv.pipeline import CAG, generate_text  # noqa: E402
from cagkv.stores import CacheStore  # noqa: E402
from cagkv.stores.embed import HashEmbedder  # noqa: E402

from engine_helpers import make_model_dir  # noqa: E402

TEXTS = {
    "cats": "The cat sat on the mat. The cat is black and sleeps all day. Cats like warm mats.",
    "paris": "Paris is the capital of France. The river Seine runs through Paris.",
    "ship": "In 1912 the ship sailed from Southampton to New York with many people on board.",
}
META = {
    "cats": {"lang": "en", "year": 2001, "tags": ["animal", "home"]},
    "paris": {"lang": "fr", "year": 1999, "tags": ["city"]},
    "ship": {"lang": "en", "year": 1912, "tags": ["history", "sea"]},
}
QUESTIONS = ["Where does the cat sit?", "What is the capital of France?", "When did the ship sail?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "canonical": str(make_model_dir(root, "llama", chat=True, seed=0)),
        "other": str(make_model_dir(root, "qwen2", chat=True, seed=1)),
        "base": str(make_model_dir(root, "gemma3_text", chat=False, seed=2)),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, models: dict[str, str]) -> CacheStore:
    """One store with the three documents ingested as LlamaIndex Documents."""
    s = CacheStore.open(tmp_path_factory.mktemp("store"), canonical=models["canonical"], embedder="hash-64")
    docs = [Document(text=TEXTS[k], id_=f"doc-{k}", metadata=META[k]) for k in TEXTS]
    ingest_documents(s, docs)
    yield s
    s.close()


@pytest.fixture(scope="module")
def cag(store: CacheStore, models: dict[str, str]) -> CAG:
    return CAG(store, canonical=models["canonical"])


def _chunk_ids(nodes) -> list[str]:
    return [n.node.metadata[CHUNK_ID] for n in nodes]


# ------------------------------------------------------------------------ ingestion
def test_documents_keep_ids_and_metadata(store: CacheStore):
    docs = {d.metadata["ref_doc_id"]: d for d in store.list_documents()}
    assert set(docs) == {f"doc-{k}" for k in TEXTS}
    for key, meta in META.items():
        got = docs[f"doc-{key}"]
        assert {k: got.metadata[k] for k in meta} == meta
        assert got.chunks >= 1


def test_ingestion_pipeline_keeps_node_boundaries_and_ids(tmp_path: Path, models: dict[str, str]):
    s = CacheStore.open(tmp_path / "s", canonical=models["canonical"], embedder="hash-64")
    text = " ".join(f"Sentence number {i} talks about topic {i % 3} in detail." for i in range(12))
    doc = Document(text=text, id_="long-doc", metadata={"file_path": "/data/long.txt", "author": "x"})
    splitter = SentenceSplitter(chunk_size=64, chunk_overlap=0)
    pipeline = IngestionPipeline(transformations=[splitter, CagkvWriter(store=s)], disable_cache=True)
    nodes = pipeline.run(documents=[doc])
    assert len(nodes) > 2
    (info,) = s.list_documents()
    assert info.source == "/data/long.txt" and info.chunks == len(nodes)
    assert info.metadata["author"] == "x" and info.metadata["ref_doc_id"] == "long-doc"
    assert all(n.metadata[DOCUMENT_ID] == str(info.id) for n in nodes)
    # each node is one stored chunk, in order
    assert [h.text for h in s.chunks_of(info.id)] == [n.get_content() for n in nodes]
    # retrieval gives back the original node ids and the source document relation
    hits = CagkvRetriever(s, similarity_top_k=len(nodes)).retrieve("topic 1 in detail")
    by_id = {n.node_id: n for n in nodes}
    assert {h.node.node_id for h in hits} == set(by_id)
    for h in hits:
        assert h.node.get_content() == by_id[h.node.node_id].get_content()
        assert h.node.relationships[NodeRelationship.SOURCE].node_id == "long-doc"
    # idempotent: running the pipeline again adds nothing
    pipeline.run(documents=[doc])
    assert [d.chunks for d in s.list_documents()] == [len(nodes)]
    s.close()


def test_documents_of_one_file_stay_apart(tmp_path: Path, models: dict[str, str]):
    s = CacheStore.open(tmp_path / "s", canonical=models["canonical"], embedder="hash-64")
    pages = [Document(text=t, metadata={"file_path": "/data/book.pdf", "page": i}) for i, t in enumerate(TEXTS.values())]
    ids = ingest_documents(s, pages)
    docs = {d.id: d for d in s.list_documents()}
    assert [docs[i].source for i in ids] == ["/data/book.pdf", "/data/book.pdf#2", "/data/book.pdf#3"]
    assert [docs[i].metadata["page"] for i in ids] == [0, 1, 2]
    assert ingest_documents(s, pages) == ids  # unchanged: same documents, nothing added
    assert len(s.list_documents()) == 3
    s.close()


def test_a_bad_device_is_refused_before_anything_is_written(tmp_path: Path, models: dict[str, str]):
    s = CacheStore.open(tmp_path / "s", canonical=models["canonical"], embedder="hash-64")
    docs = [Document(text=t, id_=k) for k, t in TEXTS.items()]
    for device in ("tpu", "cuda:x"):
        with pytest.raises(UsageError, match="device"):
            ingest_documents(s, docs, device=device)
        with pytest.raises(UsageError, match="device"):
            CagkvWriter(store=s, device=device)(docs)
    assert s.list_documents() == []
    assert CagkvWriter(store=s).device == "cpu"
    s.close()


def test_writer_refuses_non_text_nodes(store: CacheStore):
    from llama_index.core.schema import ImageNode

    with pytest.raises(UsageError, match="expected text"):
        CagkvWriter(store=store)([ImageNode(image="aGk=")])


# ------------------------------------------------------------------------ retrieval
def test_retriever_matches_store_search(store: CacheStore):
    retriever = CagkvRetriever(store, similarity_top_k=3)
    for q in QUESTIONS:
        nodes = retriever.retrieve(q)
        hits = store.search(q, k=3)
        assert _chunk_ids(nodes) == [str(h.chunk_id) for h in hits]
        assert [n.score for n in nodes] == pytest.approx([h.score for h in hits])
        assert [n.node.get_content() for n in nodes] == [h.text for h in hits]
        for n, h in zip(nodes, hits):
            assert n.node.metadata[DOCUMENT_ID] == str(h.document_id)
            assert n.node.relationships[NodeRelationship.SOURCE].node_id.startswith("doc-")
            # cagkv bookkeeping is not shown to the LLM
            assert CHUNK_ID not in n.node.get_content(metadata_mode="llm")


def test_retriever_uses_a_given_query_embedding(store: CacheStore):
    from llama_index.core.schema import QueryBundle

    vec = HashEmbedder(64).embed([QUESTIONS[2]])[0].tolist()
    nodes = CagkvRetriever(store, similarity_top_k=2).retrieve(QueryBundle("ignored words", embedding=vec))
    assert _chunk_ids(nodes) == [str(h.chunk_id) for h in store.search(QUESTIONS[2], k=2)]
    with pytest.raises(UsageError, match="embedding"):
        CagkvRetriever(store).retrieve(QueryBundle("x", embedding=[0.1] * 7))


def test_retriever_async_equals_sync(store: CacheStore):
    retriever = CagkvRetriever(store, similarity_top_k=2)
    sync = retriever.retrieve(QUESTIONS[1])
    async_ = asyncio.run(retriever.aretrieve(QUESTIONS[1]))
    assert _chunk_ids(async_) == _chunk_ids(sync)


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (MetadataFilters(filters=[MetadataFilter(key="lang", value="en")]), {"cats", "ship"}),
        (MetadataFilters(filters=[MetadataFilter(key="year", value=2000, operator=FilterOperator.LT)]), {"paris", "ship"}),
        (
            MetadataFilters(
                filters=[
                    MetadataFilter(key="lang", value="fr"),
                    MetadataFilter(key="year", value=1912, operator=FilterOperator.LTE),
                ],
                condition=FilterCondition.OR,
            ),
            {"paris", "ship"},
        ),
        (MetadataFilters(filters=[MetadataFilter(key="tags", value="sea", operator=FilterOperator.CONTAINS)]), {"ship"}),
        (MetadataFilters(filters=[MetadataFilter(key="tags", value=["city", "home"], operator=FilterOperator.ANY)]), {"cats", "paris"}),
        (MetadataFilters(filters=[MetadataFilter(key="lang", value=["fr", "de"], operator=FilterOperator.NIN)]), {"cats", "ship"}),
        (
            MetadataFilters(filters=[MetadataFilter(key="lang", value="en")], condition=FilterCondition.NOT),
            {"paris"},
        ),
        (
            MetadataFilters(
                filters=[MetadataFilter(key="lang", value="fr"), MetadataFilter(key="year", value=1912)],
                condition=FilterCondition.NOT,
            ),
            {"cats"},
        ),
        (
            MetadataFilters(
                filters=[
                    MetadataFilter(key="lang", value="en"),
                    MetadataFilters(
                        filters=[
                            MetadataFilter(key="source", value="cat", operator=FilterOperator.TEXT_MATCH),
                            MetadataFilter(key="year", value=1900, operator=FilterOperator.LT),
                        ],
                        condition=FilterCondition.OR,
                    ),
                ]
            ),
            {"cats"},
        ),
        (MetadataFilters(filters=[MetadataFilter(key="missing", value=None, operator=FilterOperator.IS_EMPTY)]), set(TEXTS)),
        (MetadataFilters(filters=[MetadataFilter(key="lang", value="de")]), set()),
    ],
)
def test_retriever_filters(store: CacheStore, filters: MetadataFilters, expected: set[str]):
    docs = {d.id: d.metadata["ref_doc_id"].removeprefix("doc-") for d in store.list_documents()}
    assert {docs[i] for i in matching_document_ids(store, filters)} == expected
    nodes = CagkvRetriever(store, similarity_top_k=10, filters=filters).retrieve("the cat and the ship")
    assert {docs[int(n.node.metadata[DOCUMENT_ID])] for n in nodes} == expected
    # the filtered ranking is cagkv's own ranking restricted to those documents
    allowed = [i for i, name in docs.items() if name in expected]
    if allowed:
        hits = store.search("the cat and the ship", k=10, document_ids=allowed)
        assert _chunk_ids(nodes) == [str(h.chunk_id) for h in hits]


def test_retriever_emits_callback_events(store: CacheStore):
    debug = LlamaDebugHandler()
    CagkvRetriever(store, callback_manager=CallbackManager([debug])).retrieve(QUESTIONS[0])
    assert len(debug.get_event_pairs(CBEventType.RETRIEVE)) == 1


# ------------------------------------------------------------------------ query engine
@pytest.mark.parametrize("mode", ["canonical", "native", "none"])
def test_query_equals_ask(cag: CAG, models: dict[str, str], mode: str):
    target = models["canonical"] if mode == "canonical" else models["other"]
    engine = CagkvQueryEngine(cag, target=target, mode=mode, top_k=2, max_new_tokens=8)
    for q in QUESTIONS[:2]:
        response = engine.query(q)
        answer = cag.ask(q, target=target, mode=mode, top_k=2, max_new_tokens=8)
        assert isinstance(response, Response)
        assert response.response == answer.text
        assert _chunk_ids(response.source_nodes) == [s.chunk for s in answer.sources]
        assert [n.score for n in response.source_nodes] == pytest.approx([s.score for s in answer.sources])
        meta = response.metadata
        assert meta["mode"] == answer.mode == mode and meta["target"] == answer.target
        assert set(meta["timings_ms"]) == set(answer.timings_ms) and meta["timings_ms"]["total"] > 0
        assert meta["tokens"]["generated"] == answer.tokens["generated"]


def test_streaming_equals_ask(cag: CAG, models: dict[str, str]):
    engine = CagkvQueryEngine(cag, mode="canonical", top_k=2, max_new_tokens=8, streaming=True)
    response = engine.query(QUESTIONS[0])
    assert isinstance(response, StreamingResponse)
    pieces = list(response.response_gen)
    answer = cag.ask(QUESTIONS[0], mode="canonical", top_k=2, max_new_tokens=8)
    assert "".join(pieces).strip() == answer.text and len(pieces) >= 1
    assert _chunk_ids(response.source_nodes) == [s.chunk for s in answer.sources]
    assert response.metadata["mode"] == "canonical"
    # the response's text helpers work on a fresh stream too
    assert str(engine.query(QUESTIONS[0])).strip() == answer.text


def test_aquery_equals_ask(cag: CAG, models: dict[str, str]):
    engine = CagkvQueryEngine(cag, target=models["other"], mode="native", top_k=2, max_new_tokens=8)
    answer = cag.ask(QUESTIONS[1], target=models["other"], mode="native", top_k=2, max_new_tokens=8)

    async def run() -> list:
        return await asyncio.gather(engine.aquery(QUESTIONS[1]), engine.aquery(QUESTIONS[1]))

    for response in asyncio.run(run()):
        assert isinstance(response, Response) and response.response == answer.text
        assert _chunk_ids(response.source_nodes) == [s.chunk for s in answer.sources]


def test_async_streaming_equals_ask(cag: CAG):
    engine = CagkvQueryEngine(cag, mode="canonical", top_k=2, max_new_tokens=8, streaming=True)

    async def run() -> tuple[str, AsyncStreamingResponse]:
        response = await engine.aquery(QUESTIONS[2])
        assert isinstance(response, AsyncStreamingResponse)
        text = "".join([piece async for piece in response.async_response_gen()])
        return text, response

    text, response = asyncio.run(run())
    answer = cag.ask(QUESTIONS[2], mode="canonical", top_k=2, max_new_tokens=8)
    assert text.strip() == answer.text
    assert _chunk_ids(response.source_nodes) == [s.chunk for s in answer.sources]
    assert response.metadata["timings_ms"]["first_token"] > 0


def test_query_engine_filters_restrict_sources(cag: CAG, store: CacheStore):
    filters = MetadataFilters(filters=[MetadataFilter(key="lang", value="fr")])
    engine = CagkvQueryEngine(cag, mode="canonical", top_k=3, max_new_tokens=4, filters=filters)
    response = engine.query("the cat and the ship")
    (paris,) = [d.id for d in store.list_documents() if d.metadata["lang"] == "fr"]
    assert response.source_nodes and all(
        n.node.metadata[DOCUMENT_ID] == str(paris) for n in response.source_nodes
    )
    answer = cag.ask("the cat and the ship", mode="canonical", top_k=3, max_new_tokens=4, document_ids=[paris])
    assert response.response == answer.text
    # no document passes: the answer has no sources, as cagkv's own with no documents allowed
    none = MetadataFilters(filters=[MetadataFilter(key="lang", value="de")])
    empty = CagkvQueryEngine(cag, mode="canonical", max_new_tokens=4, filters=none).query("the cat")
    assert empty.source_nodes == []
    assert empty.response == cag.ask("the cat", mode="canonical", max_new_tokens=4, document_ids=[]).text


def test_query_engine_as_tool_and_retrieve(cag: CAG):
    engine = CagkvQueryEngine(cag, mode="canonical", top_k=2, max_new_tokens=8)
    tool = QueryEngineTool.from_defaults(engine, name="docs", description="Answers about the documents.")
    answer = cag.ask(QUESTIONS[1], mode="canonical", top_k=2, max_new_tokens=8)
    out = tool.call(QUESTIONS[1])
    assert out.content == answer.text and out.raw_output.metadata["mode"] == "canonical"
    assert asyncio.run(tool.acall(QUESTIONS[1])).content == answer.text
    retrieved = engine.retrieve(QUESTIONS[1])
    assert _chunk_ids(retrieved) == [s.chunk for s in answer.sources]


def test_query_engine_emits_events(cag: CAG):
    debug = LlamaDebugHandler()
    engine = CagkvQueryEngine(cag, mode="canonical", max_new_tokens=4, callback_manager=CallbackManager([debug]))
    engine.query(QUESTIONS[0])
    (pair,) = debug.get_event_pairs(CBEventType.SYNTHESIZE)
    assert str(pair[1].payload["response"]) == str(cag.ask(QUESTIONS[0], mode="canonical", max_new_tokens=4).text)


def test_bad_question_is_a_cagkv_error(cag: CAG):
    with pytest.raises(UsageError):
        CagkvQueryEngine(cag).query("   ")


# ------------------------------------------------------------------------ LLM and embeddings
def test_llm_complete_and_stream_under_settings(models: dict[str, str]):
    loaded = load(models["base"])
    llm = CagkvLLM(model=models["base"], loaded=loaded, max_new_tokens=6)
    prompt = "The cat sat on the"
    expected = "".join(generate_text(loaded, loaded.tokenizer(prompt)["input_ids"], max_new_tokens=6))
    assert expected
    old = Settings._llm
    try:
        Settings.llm = llm
        assert Settings.llm.complete(prompt).text == expected
        deltas = [r.delta for r in Settings.llm.stream_complete(prompt)]
        assert "".join(deltas) == expected
        assert asyncio.run(Settings.llm.acomplete(prompt)).text == expected
        meta = Settings.llm.metadata
        assert meta.model_name == models["base"] and not meta.is_chat_model and meta.num_output == 6
        # base model: chat goes through messages_to_prompt, still the same generator
        chat = Settings.llm.chat([ChatMessage(role="user", content="hi")])
        assert chat.message.role.value == "assistant"
    finally:
        Settings._llm = old


def test_llm_chat_uses_the_chat_template(models: dict[str, str]):
    loaded = load(models["canonical"])
    llm = CagkvLLM(model=models["canonical"], loaded=loaded, max_new_tokens=6)
    assert llm.metadata.is_chat_model
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Is it raining?")]
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": m.role.value, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True
    )
    ids = loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = "".join(generate_text(loaded, ids, max_new_tokens=6))
    assert expected  # a prompt the tiny model answers with text
    assert llm.chat(messages).message.content == expected
    streamed = list(llm.stream_chat(messages))
    assert "".join(r.delta for r in streamed) == expected and streamed[-1].message.content == expected


def test_llm_refuses_prompts_over_the_context_window(models: dict[str, str]):
    llm = CagkvLLM(model=models["base"], loaded=load(models["base"]), max_new_tokens=4, context_window=8)
    with pytest.raises(UsageError, match="context_window"):
        llm.complete("word " * 20)


def test_embedding_under_settings_matches_the_store_embedder(store: CacheStore):
    embedder = HashEmbedder(64)
    emb = CagkvEmbedding(embedder=embedder)
    assert emb.model_name == "hash-64"
    texts = list(TEXTS.values())
    assert np.allclose(emb.get_text_embedding_batch(texts), embedder.embed(texts), atol=1e-6)
    assert emb.get_query_embedding(QUESTIONS[0]) == pytest.approx(embedder.embed([QUESTIONS[0]])[0].tolist())
    old = Settings._embed_model
    try:
        Settings.embed_model = emb
        # a LlamaIndex vector index built with Settings.embed_model ranks like the cagkv store
        nodes = [TextNode(text=t, id_=k) for k, t in TEXTS.items()]
        top = VectorStoreIndex(nodes).as_retriever(similarity_top_k=1).retrieve(QUESTIONS[1])
        assert top[0].node.node_id == "paris"
        assert store.search(QUESTIONS[1], k=1)[0].text == TEXTS["paris"]
    finally:
        Settings._embed_model = old


def test_retriever_and_llm_compose_in_a_retriever_query_engine(store: CacheStore, models: dict[str, str]):
    """LlamaIndex's own RetrieverQueryEngine over the cagkv retriever and LLM (text prompt)."""
    from llama_index.core.query_engine import RetrieverQueryEngine

    llm = CagkvLLM(model=models["canonical"], loaded=load(models["canonical"]), max_new_tokens=4)
    retriever = CagkvRetriever(store, similarity_top_k=2)
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm, response_mode="compact")
    response = engine.query(QUESTIONS[1])
    assert isinstance(response.response, str)
    assert _chunk_ids(response.source_nodes) == [str(h.chunk_id) for h in store.search(QUESTIONS[1], k=2)]


def test_missing_llama_index_gives_an_install_hint():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['llama_index'] = None; sys.modules['llama_index.core'] = None\n"
        "import cagkv.integrations as i\n"
        "try:\n    i.CagkvRetriever\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'llama-index-core" in out.stdout, out.stderr
