"""Quickstart: prefill documents once with the canonical model, answer with another model.

    .venv/bin/python examples/quickstart.py                       # fresh store under /tmp
    .venv/bin/python examples/quickstart.py --store DIR --skip-ingest --target gemma3-270m

1. `cagkv.ingest_files` chunks examples/docs/ by canonical-model tokens (SmolLM2-135M),
   prefills every chunk once and stores its KV cache (safetensors blobs + SQL catalog +
   FAISS index of MiniLM embeddings).
2. `CAG.ask` answers each question three ways, from the same retrieved chunks:
   - the target (not the canonical model) in `auto` mode: from translated caches when a
     trained translator for (canonical, target) passes its quality threshold, otherwise it
     falls back to prefilling the chunk text itself; the answer says which mode ran;
   - the target's native prefill of the retrieved text (the baseline);
   - the canonical model from its stored caches (`canonical`: no document prefill at all).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import cagkv
from cagkv.pipeline import CAG, Answer

DOCS = Path(__file__).resolve().parent / "docs"
QUESTIONS = [
    "What happens when a pass statement is executed?",
    "Which loop does a break statement terminate?",
    "What value does return give when no expression list is present?",
]


def doc_files() -> list[str]:
    """The example documents (SOURCES.md describes them; it is not one of them)."""
    return [str(p) for p in sorted(DOCS.iterdir()) if p.suffix in {".txt", ".md", ".html"} and p.name != "SOURCES.md"]


def show(label: str, answer: Answer) -> None:
    t = answer.timings_ms
    print(f"  {label}")
    print(f"    answer : {answer.text}")
    print(
        "    ms     : "
        + " | ".join(f"{k} {t[k]:.0f}" for k in ("retrieve", "load", "translate", "replay", "prefill"))
        + f" | first token {t['first_token']:.0f} | total {t['total']:.0f}"
        + f"   ({answer.tokens['context']} context tokens)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store folder (default: a fresh temporary folder)")
    parser.add_argument("--skip-ingest", action="store_true", help="use the store as it is")
    parser.add_argument("--target", default="gemma3-270m", help="answering model (not the canonical one)")
    parser.add_argument("--mode", default="auto", help="mode for the target: auto or translate")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    store = args.store or tempfile.mkdtemp(prefix="cagkv-quickstart-")
    if not args.skip_ingest:
        report = cagkv.ingest_files(doc_files(), store=store, chunk_tokens=args.chunk_tokens)
        print(report.summary())
    cag = CAG.open(store)
    print(f"store {store}: canonical model {cag.canonical}, target {args.target}\n")
    for question in QUESTIONS:
        kw = {"top_k": args.top_k, "max_new_tokens": args.max_new_tokens}
        stored = cag.ask(question, target=args.target, mode=args.mode, **kw)
        native = cag.ask(question, target=args.target, mode="native", **kw)
        canonical = cag.ask(question, mode="canonical", **kw)
        print(f"Q: {question}")
        ran = f"mode {stored.mode}" + (f" - {stored.mode_reason}" if stored.mode_reason else "")
        show(f"{stored.target}, {args.mode} -> {ran}", stored)
        show(f"{native.target}, native prefill of the retrieved text (baseline)", native)
        show(f"{canonical.target}, canonical: its stored caches, no document prefill", canonical)
        names = ", ".join(f"{Path(s.source).name} chunk {s.chunk} ({s.score:.2f})" for s in stored.sources)
        print(f"  sources: {names}\n")


if __name__ == "__main__":
    main()
