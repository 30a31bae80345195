"""The LlamaIndex example end to end with the real models (reader -> ingestion -> query engine)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ("smollm2-135m", "gemma3-270m", "minilm-l6")


def _example():
    spec = importlib.util.spec_from_file_location("llamaindex_example", ROOT / "examples" / "llamaindex_query_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pytest.importorskip("llama_index.core")
    import torch

    from cagkv.models import zoo

    missing = [n for n in NEEDED if not zoo.is_present(n)]
    if missing:
        pytest.skip(f"real models {missing} are not in {zoo.models_dir()}: run `cagkv models pull`")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from llama_index.core import Settings

    from cagkv.integrations.llama_index import CagkvEmbedding, CagkvLLM
    from cagkv.stores import CacheStore

    question = "Which loop does a break statement terminate?"
    store_dir = tmp_path / "store"
    saved = Settings._llm, Settings._embed_model
    try:
        results = _example().main(
            ["--store", str(store_dir), "--question", question, "--max-new-tokens", "12"]
        )
        # LlamaIndex's defaults were pointed at the local models, not OpenAI
        assert isinstance(Settings.llm, CagkvLLM) and isinstance(Settings.embed_model, CagkvEmbedding)
    finally:
        Settings._llm, Settings._embed_model = saved
    out = capsys.readouterr().out
    (result,) = results
    assert result["answer"].strip(), out
    assert result["target"] == "gemma3-270m"
    assert result["mode"] in ("translate", "native"), result  # auto: translated when a translator exists
    assert set(result["timings_ms"]) >= {"retrieve", "prefill", "first_token", "total"}
    assert result["sources"] and "tool 'documents'" in out

    # every node the pipeline made is a stored chunk, and the best source is the break text
    with CacheStore.open(store_dir) as store:
        docs = store.list_documents()
        assert {Path(d.source).name for d in docs} == {"python_statements.md", "python_truth_values.txt"}
        node_ids = {nid for d in docs for nid in d.metadata["llama_index_node_ids"]}
        assert set(result["sources"]) <= node_ids
        best = store.search(question, k=1)[0]
        assert "break" in best.text


def test_llm_and_embedding_with_real_models():
    pytest.importorskip("llama_index.core")
    from cagkv.models import zoo

    missing = [n for n in ("smollm2-135m", "minilm-l6") if not zoo.is_present(n)]
    if missing:
        pytest.skip(f"real models {missing} are not in {zoo.models_dir()}: run `cagkv models pull`")
    from llama_index.core.base.llms.types import ChatMessage

    from cagkv.integrations.llama_index import CagkvEmbedding, CagkvLLM
    from cagkv.stores.embed import MiniLMEmbedder

    llm = CagkvLLM(model="smollm2-135m", max_new_tokens=12)
    assert llm.metadata.is_chat_model  # SmolLM2-Instruct has a chat template
    reply = llm.chat([ChatMessage(role="user", content="What is the capital of France?")])
    assert "paris" in reply.message.content.lower()
    streamed = "".join(r.delta for r in llm.stream_chat([ChatMessage(role="user", content="What is the capital of France?")]))
    assert streamed == reply.message.content

    emb = CagkvEmbedding()
    vec = emb.get_query_embedding("What does break do?")
    assert len(vec) == 384
    ref = MiniLMEmbedder().embed(["What does break do?"])[0]
    assert max(abs(a - float(b)) for a, b in zip(vec, ref)) < 1e-5
