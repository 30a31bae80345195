"""Ingest throughput against raw canonical prefill of the same tokens (goal: overhead <= 10 %).

    .venv/bin/python benchmarks/ingest.py [--tokens 12000] [--chunk-tokens 256] [--batch-size 8]

Corpus: the Python Language Reference topics shipped in `pydoc_data.topics` (real text,
PSF licence, not an evaluation set), cut to about `--tokens` canonical tokens and written
as one file per topic. Both measurements run in this process after the model and the
embedder are loaded (one-time costs excluded), alternating `--repeats` times:

- raw:    forward passes over exactly the sequences ingest prefills (context prefix +
          chunk + separator), in the same batches, nothing else;
- ingest: `cagkv.ingest.ingest_sources` into a fresh store: read, chunk, prefill, un-rotate,
          serialise, checksum, write blobs, embed (MiniLM), catalog rows, FAISS index.

Overhead = (ingest - raw) / raw, from the medians. Results: docs/benchmarks/ingest.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"


def corpus(folder: Path, tokenizer, max_tokens: int) -> list[Path]:
    """Python reference topics as files, about `max_tokens` tokens in all."""
    from pydoc_data import topics

    files, total = [], 0
    for name in sorted(topics.topics):
        text = topics.topics[name].strip()
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if total and total + n > max_tokens:
            continue
        path = folder / f"{name}.txt"
        path.write_text(text + "\n")
        files.append(path)
        total += n
        if total >= max_tokens * 0.97:
            break
    return files


@torch.inference_mode()
def raw_prefill(loaded, fmt, chunk_texts: list[str], batch_size: int) -> float:
    """Seconds for forward passes over prefix + chunk, batched like prefill_chunks."""
    prefix = fmt.context_prefix_ids()
    sep = fmt.separator_ids()
    seqs = sorted((fmt.chunk_ids(t) + sep for t in chunk_texts), key=len, reverse=True)
    pad = loaded.tokenizer.pad_token_id or 0
    t0 = time.perf_counter()
    for i in range(0, len(seqs), batch_size):
        batch = seqs[i : i + batch_size]
        tmax = max(map(len, batch))
        ids = torch.tensor([prefix + s + [pad] * (tmax - len(s)) for s in batch])  # [B, P+Tmax]
        loaded.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--canonical", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=12000)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--embedder", default="minilm-l6")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from cagkv.stores import CacheStore

    from cagkv.chunking import chunk_text
    from cagkv.ingest import collect_sources, ingest_sources, parse_dtype, read_document
    from cagkv.models import load
    from cagkv.prompt import PromptFormat

    dtype = parse_dtype(args.dtype)
    loaded = load(args.canonical, dtype=dtype)
    fmt = PromptFormat.for_model(loaded)
    work = Path(tempfile.mkdtemp(prefix="cagkv-bench-ingest-"))
    docs = work / "docs"
    docs.mkdir()
    files = corpus(docs, loaded.tokenizer, args.tokens)
    sources = collect_sources([str(f) for f in files])
    chunks = [c.text for s in sources for c in chunk_text(read_document(s), loaded.tokenizer, args.chunk_tokens)]
    tokens = sum(len(fmt.chunk_ids(c)) + len(fmt.separator_ids()) for c in chunks)
    print(f"corpus: {len(files)} files, {len(chunks)} chunks, {tokens} chunk tokens; dtype {dtype}", flush=True)

    raw_rounds: list[float] = []
    ingest_rounds: list[dict] = []
    raw_prefill(loaded, fmt, chunks[: args.batch_size], args.batch_size)  # warm-up
    for r in range(args.repeats):
        raw_rounds.append(raw_prefill(loaded, fmt, chunks, args.batch_size))
        store = CacheStore.open(work / f"store{r}", canonical=args.canonical, fingerprint=loaded.fingerprint,
                                embedder=args.embedder)  # fmt: skip
        store.embedder.embed(["warm up"])  # loading the embedder is a one-time cost
        report = ingest_sources(store, loaded, sources, args.chunk_tokens, args.batch_size, progress=False)
        store.close()
        assert report.tokens == tokens, (report.tokens, tokens)
        ingest_rounds.append(report.to_dict() | {"seconds_exact": report.seconds,
                                                  "prefill_seconds_exact": report.prefill_seconds})  # fmt: skip
        print(f"round {r}: raw {raw_rounds[-1]:.1f} s, ingest {report.seconds:.1f} s "
              f"(prefill + un-rotate {report.prefill_seconds:.1f} s)", flush=True)  # fmt: skip

    raw = statistics.median(raw_rounds)
    ing = statistics.median(r["seconds_exact"] for r in ingest_rounds)
    pre = statistics.median(r["prefill_seconds_exact"] for r in ingest_rounds)
    result = {
        "benchmark": "ingest",
        "command": "python benchmarks/ingest.py " + " ".join(sys.argv[1:]),
        "canonical": args.canonical,
        "dtype": str(dtype).replace("torch.", ""),
        "embedder": args.embedder,
        "chunk_tokens": args.chunk_tokens,
        "batch_size": args.batch_size,
        "documents": len(files),
        "chunks": len(chunks),
        "tokens": tokens,
        "raw_prefill_s": round(raw, 2),
        "ingest_s": round(ing, 2),
        "ingest_prefill_s": round(pre, 2),
        "raw_tokens_per_s": round(tokens / raw, 1),
        "ingest_tokens_per_s": round(tokens / ing, 1),
        "overhead": round((ing - raw) / raw, 4),
        "bytes": ingest_rounds[-1]["bytes"],
        "rounds": {"raw_s": [round(x, 2) for x in raw_rounds], "ingest": ingest_rounds},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": torch.get_num_threads(), "load_avg": os.getloadavg()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ingest.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# Ingest throughput vs raw canonical prefill",
        "",
        f"Command: `{result['command']}`",
        "",
        (f"{len(files)} documents (Python reference topics), {len(chunks)} chunks of <= {args.chunk_tokens} "
        f"tokens, {tokens} tokens, {args.canonical} in {result['dtype']}, batch {args.batch_size}, "
        f"embedder {args.embedder}; median of {args.repeats} alternating rounds; "
        f"{result['machine']['cores']} cores, load average {result['machine']['load_avg'][0]:.1f} at the end."),
        "",
        "| | seconds | tokens/s |",
        "|---|---|---|",
        f"| raw prefill (forward passes only) | {raw:.1f} | {tokens / raw:.0f} |",
        f"| ingest: prefill + un-rotate + blocks | {pre:.1f} | {tokens / pre:.0f} |",
        f"| ingest: everything (store writes, hashing, embedding, index) | {ing:.1f} | {tokens / ing:.0f} |",
        "",
        f"**Overhead of ingest over raw prefill: {100 * result['overhead']:.1f} %** (goal: at most 10 %).",
        "",
    ]
    (out / "ingest.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
