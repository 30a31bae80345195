"""Soak the store: ingest N chunks, ask Q questions, record time and peak memory.

No model: KV blocks are random tensors of a chosen shape (default 4 layers x 2 heads x
~60 tokens x 32 dims, bf16), embeddings from the HashEmbedder, so the figures measure
the store (catalog + blobs + FAISS + checks), not a model. Memory is the process RSS,
sampled every 100 questions; "flat" means the last sample is within 5 % (or 8 MiB) of
the sample after the first 100 questions.

    .venv/bin/python benchmarks/store_soak.py --chunks 5000 --questions 1000 --json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "reliability"))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=5000)
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--per-doc", type=int, default=10, help="chunks per document")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--store", default=None, help="store folder (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import storekit
    from storekit import TextChunk, open_store

    from cagkv.kv import KVBlock

    def block(text: str, seed: int) -> KVBlock:
        t = len(text.split())
        g = torch.Generator().manual_seed(seed)
        starts, pos = [], 0
        for w in text.split():
            pos = text.index(w, pos)
            starts.append((pos, pos + len(w)))
            pos += len(w)
        return KVBlock(
            torch.randn(4, 2, t, 32, generator=g).to(torch.bfloat16),
            torch.randn(4, 2, t, 32, generator=g).to(torch.bfloat16),
            torch.arange(t, dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int64),
            text,
            storekit.FP,
        )

    root = Path(args.store or tempfile.mkdtemp(prefix="cagkv-soak-")) / "store"
    store = open_store(root)
    n_docs = (args.chunks + args.per_doc - 1) // args.per_doc
    rss0 = rss_mib()
    t0 = time.perf_counter()
    made = 0
    with store.batch():  # lock held once, index saved at the end
        for d in range(n_docs):
            sents = [
                f"Fact {j} of doc{d} says topic{d}w{j} relates to ver0x{d}x{j} and more{d} " + "filler " * 40
                for j in range(min(args.per_doc, args.chunks - made))
            ]
            text = "".join(s.strip() + ". " for s in sents).strip()
            pairs, pos = [], 0
            for j, s in enumerate(sents):
                s = s.strip() + "."
                start = text.index(s, pos)
                pairs.append((TextChunk(s, start, start + len(s)), block(s, d * 1000 + j)))
                pos = start + len(s)
            store.add_document(f"doc{d}.txt", text, {"d": d}, pairs)
            made += len(sents)
    ingest_s = time.perf_counter() - t0
    rss_ingest = rss_mib()

    samples = []
    lat = []
    correct = 0
    t1 = time.perf_counter()
    for q in range(args.questions):
        d, j = (q * 7919) % n_docs, q % args.per_doc
        tq = time.perf_counter()
        pairs = store.retrieve(f"Fact {j} of doc{d} says topic{d}w{j} relates to what", k=args.k)
        lat.append((time.perf_counter() - tq) * 1000)
        correct += pairs[0][0].source == f"doc{d}.txt"
        if (q + 1) % 100 == 0:
            samples.append(round(rss_mib(), 1))
    ask_s = time.perf_counter() - t1
    lat.sort()
    flat = len(samples) < 2 or samples[-1] - samples[0] <= max(8.0, 0.05 * samples[0])
    st = store.stats()
    result = {
        "command": "python benchmarks/store_soak.py " + " ".join(sys.argv[1:]),
        "chunks": st["chunks"],
        "documents": st["documents"],
        "stored_mib": round(st["bytes"] / 2**20, 1),
        "ingest_s": round(ingest_s, 1),
        "ingest_chunks_per_s": round(st["chunks"] / ingest_s, 1),
        "questions": args.questions,
        "ask_s": round(ask_s, 1),
        "retrieve_ms_p50": round(lat[len(lat) // 2], 2),
        "retrieve_ms_p95": round(lat[int(len(lat) * 0.95)], 2),
        "top1_correct": correct / args.questions,
        "rss_mib_start": round(rss0, 1),
        "rss_mib_after_ingest": round(rss_ingest, 1),
        "rss_mib_every_100_questions": samples,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "memory_flat": flat,
        "doctor_ok": store.doctor().ok,
    }
    print(json.dumps(result, indent=None if args.json else 2))
    if not flat:
        sys.exit(1)


if __name__ == "__main__":
    main()
