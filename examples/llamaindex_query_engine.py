"""cagkv under a LlamaIndex pipeline: reader -> cagkv ingestion -> query engine.

A LlamaIndex reader loads the documents, an IngestionPipeline splits them into nodes and
writes them into a cagkv store (the canonical model prefills each node once), and a
cagkv query engine answers with the stored caches translated for another model, printing
the answer, its sources and cagkv's timing split. Nothing reaches the network: LlamaIndex's
LLM and embedding defaults point at the same local models.

Run (after `scripts/setup.sh` and `cagkv pull`):
    .venv/bin/python examples/llamaindex_query_engine.py
    .venv/bin/python examples/llamaindex_query_engine.py --target gemma3-270m \
        --question "What does break do?" --store /tmp/cagkv-llamaindex
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llama_index.core import Settings, SimpleDirectoryReader
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.tools import QueryEngineTool

from cagkv.integrations.llama_index import (
    CagkvEmbedding,
    CagkvLLM,
    CagkvQueryEngine,
    CagkvWriter,
)
from cagkv.pipeline import CAG
from cagkv.stores import CacheStore

HERE = Path(__file__).resolve().parent
QUESTIONS = [
    "What happens when a pass statement is executed?",
    "Which loop does a break statement terminate?",
]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", default=str(HERE / "docs"), help="folder of .txt/.md documents")
    p.add_argument("--store", default=None, help="cagkv store folder (default: a temp folder)")
    p.add_argument("--canonical", default="smollm2-135m", help="model that prefills the caches")
    p.add_argument("--target", default="gemma3-270m", help="model that answers")
    p.add_argument("--mode", default="translate", help="translate | auto | canonical | native | none")
    p.add_argument("--question", action="append", help="question (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--chunk-size", type=int, default=200, help="SentenceSplitter chunk size")
    args = p.parse_args(argv)
    store_dir = args.store or tempfile.mkdtemp(prefix="cagkv-llamaindex-")

    # 1. Offline LlamaIndex defaults: the local target model and cagkv's embedder.
    Settings.llm = CagkvLLM(model=args.target, max_new_tokens=args.max_new_tokens)
    Settings.embed_model = CagkvEmbedding()

    # 2. A LlamaIndex reader, then an IngestionPipeline that ends in the cagkv store.
    documents = SimpleDirectoryReader(
        args.docs, required_exts=[".txt", ".md"], exclude=["SOURCES.md"]
    ).load_data()
    store = CacheStore.open(store_dir, canonical=args.canonical)
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=args.chunk_size, chunk_overlap=0),
            CagkvWriter(store=store),
        ]
    )
    nodes = pipeline.run(documents=documents)
    print(f"ingested {len(documents)} document(s) as {len(nodes)} node(s) into {store_dir}")

    # 3. A query engine answering from the stored caches, translated for another model.
    cag = CAG(store)
    mode = args.mode
    canonical, target = cag.model(cag.canonical), cag.model(args.target)
    if mode == "translate" and target.fingerprint == canonical.fingerprint:
        mode = "canonical"  # the canonical model reads its own caches: nothing to translate
    elif mode == "translate" and cag.translator_for(canonical, target) is None:
        print(f"no translator {cag.canonical} -> {args.target} installed (train one with "
              "`cagkv train`): using --mode auto")
        mode = "auto"
    engine = CagkvQueryEngine(cag, target=args.target, mode=mode, max_new_tokens=args.max_new_tokens)
    results = []
    for question in args.question or QUESTIONS:
        response = engine.query(question)
        meta = response.metadata or {}
        print(f"\nQ: {question}\nA: {str(response).strip()}")
        timings = " ".join(f"{k}={v:.0f}" for k, v in meta["timings_ms"].items())
        print(f"   target={meta['target']} mode={meta['mode']} ({meta['mode_reason']})")
        print(f"   timings_ms: {timings}")
        for source in response.source_nodes:
            name = Path(source.node.metadata.get("file_name", "?")).name
            print(f"   [{source.score:.3f}] {name} node {source.node.node_id[:8]}: "
                  f"{source.node.get_content()[:70]!r}")
        results.append({"question": question, "answer": str(response), **meta,
                        "sources": [s.node.node_id for s in response.source_nodes]})

    # 4. The same engine as a tool, as a LlamaIndex agent would call it.
    tool = QueryEngineTool.from_defaults(
        engine, name="documents", description="Answers questions about the ingested documents."
    )
    print(f"\ntool {tool.metadata.name!r} -> {tool.call(results[0]['question']).content!r}")
    return results


if __name__ == "__main__":
    main()
