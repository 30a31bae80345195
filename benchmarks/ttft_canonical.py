"""Time to first token: `canonical` (stored caches) against `native` (the model prefills the
retrieved text itself), same model, same retrieved chunks, at several context lengths.

    .venv/bin/python benchmarks/ttft_canonical.py [--lengths 512 2048 8192] [--repeats 2]

Corpus: Python Language Reference topics (`pydoc_data.topics`, PSF licence, not an
evaluation set), ingested once into a store (float32 blocks, the dtype the model answers
in). For a target length L the engine retrieves k chunks with k * (mean chunk tokens) ~ L;
both modes get the same chunks. One-time costs (loading the model, the embedder, the
context-prefix cache) are paid before timing. Each mode runs `--repeats` times,
alternating; medians are reported. Results: docs/benchmarks/ttft_canonical.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
QUESTION = "How does Python evaluate an expression statement?"
PHASES = ("retrieve", "load", "translate", "prefill", "first_token")


def build_store(store: Path, model: str, tokens: int, chunk_tokens: int, dtype: str) -> None:
    from cagkv.ingest import ingest
    from cagkv.models import load

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ingest import corpus  # the same corpus helper as the ingest benchmark

    docs = store.parent / "ttft-docs"
    docs.mkdir(parents=True, exist_ok=True)
    files = corpus(docs, load(model).tokenizer, tokens)
    report = ingest([str(f) for f in files], store, canonical=model, chunk_tokens=chunk_tokens, dtype=dtype,
                    progress=False)  # fmt: skip
    print(report.summary(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", help="answering and stored-block dtype")
    ap.add_argument("--store", help="reuse (or build) the store here (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from cagkv.pipeline import CAG

    store = Path(args.store or tempfile.mkdtemp(prefix="cagkv-bench-ttft-")) / "store"
    if not (store / "catalog.db").exists():
        build_store(store, args.model, max(args.lengths) + 4 * args.chunk_tokens, args.chunk_tokens, args.dtype)
    cag = CAG.open(str(store), dtype=args.dtype)
    stats = cag.store.stats()
    mean_chunk = stats["tokens"] / max(1, stats["chunks"])
    limit = cag.model(args.model).config.max_position_embeddings
    cag.ask(QUESTION, mode="canonical", top_k=1, max_new_tokens=1)  # warm-up: loads, prefix cache
    cag.ask(QUESTION, mode="native", top_k=1, max_new_tokens=1)

    rows = []
    for length in args.lengths:
        k = max(1, math.ceil(length / mean_chunk))  # at least L context tokens where possible
        while k > 1 and k * mean_chunk + 96 > limit:  # stay inside the model's trained positions
            k -= 1
        runs: dict[str, list] = {"canonical": [], "native": []}
        for _ in range(args.repeats):
            for mode, answers in runs.items():
                a = cag.ask(QUESTION, mode=mode, top_k=k, max_new_tokens=1)
                answers.append(a)
                print(f"L={length} k={k} {mode}: context {a.tokens['context']} tokens, first token "
                      f"{a.timings_ms['first_token']:.0f} ms", flush=True)  # fmt: skip
        context = {m: {a.tokens["context"] for a in r} for m, r in runs.items()}
        assert context["canonical"] == context["native"], context  # same chunks, same tokens
        med = {m: {p: statistics.median(a.timings_ms[p] for a in r) for p in PHASES} for m, r in runs.items()}
        rows.append({
            "target_tokens": length,
            "chunks": k,
            "context_tokens": runs["native"][0].tokens["context"],
            "prompt_tokens": runs["native"][0].tokens["prompt"],
            "canonical_ms": {p: round(v, 1) for p, v in med["canonical"].items()},
            "native_ms": {p: round(v, 1) for p, v in med["native"].items()},
            "speedup": round(med["native"]["first_token"] / med["canonical"]["first_token"], 2),
            "raw_first_token_ms": {m: [round(a.timings_ms["first_token"], 1) for a in r] for m, r in runs.items()},
        })  # fmt: skip

    result = {
        "benchmark": "ttft_canonical",
        "command": "python benchmarks/ttft_canonical.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": torch.get_num_threads(), "load_avg": os.getloadavg()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_canonical.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# Time to first token: canonical (stored caches) vs native prefill",
        "",
        f"Command: `{result['command']}`",
        "",
        (f"{args.model} in {args.dtype}, chunks of <= {args.chunk_tokens} tokens, same retrieved chunks in both "
        f"modes, median of {args.repeats}; {result['machine']['cores']} cores, load average "
        f"{result['machine']['load_avg'][0]:.1f} at the end. Times in ms; canonical's `prefill` is the "
        "assembly (stored keys rotated to their positions and appended to the prefix cache, which is "
        "computed once per model) plus the forward of the question suffix."),
        "",
        ("| context tokens | chunks | canonical: retrieve / load / prefill | canonical TTFT | native: retrieve / prefill "
        "| native TTFT | speedup |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, n = r["canonical_ms"], r["native_ms"]
        md.append(
            f"| {r['context_tokens']} | {r['chunks']} | {c['retrieve']:.0f} / {c['load']:.0f} / {c['prefill']:.0f} "
            f"| {c['first_token']:.0f} | {n['retrieve']:.0f} / {n['prefill']:.0f} | {n['first_token']:.0f} "
            f"| {r['speedup']:.1f}x |"
        )
    md.append("")
    (out / "ttft_canonical.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
