"""Does more of the question's attention on a translated chunk help? A logit bias at question time.

For each question (one chunk, oracle retrieval, the real ingest / assemble path) the gold
answer is scored after the translated cache (r = 0) with a constant `b` added to the
attention logits of every translated chunk position, in every layer and head, for the
question and answer tokens (`cagkv.models.layers.AttentionBias`, as `CAG.prepare(attention_bias=)`
applies it, but on the positions this probe names: E86's grid left the chunk's last
separator-length tokens unbiased); nothing else changes. b = 0 is the plain translated cache. `none` and
`native` are scored the same way as `cagkv eval` does, so the recovery of native's gain
and the paired difference against b = 0 come out of one run (docs/EXPERIMENTS.md E86).

Example (E86, the first 60 questions of the SQuAD draw):
    CAGKV_LINEAR_DTYPE=float32 python benchmarks/attention_bias_probe.py --target qwen2.5-0.5b \\
        --stop 60 --biases -0.26,0.13,0.26,0.5 --out docs/results/attention_bias_e86_qwen25.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cagkv.eval.datasets import load_dataset
from cagkv.eval.metrics import recovery, recovery_difference
from cagkv.eval.runner import EvalConfig, answer_logprob, default_store_factory, ingest_contexts
from cagkv.models.layers import AttentionBias
from cagkv.pipeline import CAG, Prepared
from cagkv.translate import find_translator, load_translator


def biased_logprob(prepared: Prepared, answer: str, positions: torch.Tensor, bias: float) -> float:
    """`answer_logprob` with `bias` added to the attention logits of the cached `positions` for
    the prompt's and the answer's tokens in every layer (the engine's `AttentionBias`; 0: the
    model's own forward, the plain translated cache)."""
    return answer_logprob(dataclasses.replace(prepared, bias=AttentionBias(positions, bias)), answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--canonical", default="smollm2-135m")
    ap.add_argument("--translator", default="", help="translator folder (default: the installed one)")
    ap.add_argument("--dataset", default="../shared/data/squad_v1.1_dev_even_articles.jsonl")
    ap.add_argument("--start", type=int, default=0, help="first question of the seeded draw")
    ap.add_argument("--stop", type=int, default=60)
    ap.add_argument("--biases", default="-0.26,0.13,0.26,0.5", help="comma-separated logit biases besides 0")
    ap.add_argument("--out", default="", help="write the per-question log-probs and the summary as JSON here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (logs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    biases = [float(b) for b in args.biases.split(",") if b.strip()]

    config = EvalConfig(dataset=args.dataset, canonical=args.canonical, target=args.target)
    examples = load_dataset(args.dataset, limit=args.stop, seed=0)[args.start : args.stop]
    translator = load_translator(Path(args.translator).expanduser()) if args.translator else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = default_store_factory(config)(Path(tmp) / "store")
        engine = CAG(store, canonical=args.canonical,
                     find_translator=(lambda s, t: translator) if translator else find_translator)
        engine.fuse_feed = False  # as E86's grid ran: the separators computed before the question
        documents = ingest_contexts(store, [e.context for e in examples], config, progress=not args.no_progress)
        for example, document in tqdm(list(zip(examples, documents)), desc="questions", disable=args.no_progress):
            ask = dict(target=args.target, document_ids=[document], top_k=1)
            answer = example.answers[0]
            row: dict[str, Any] = {"id": example.id}
            for mode in ("none", "native"):
                row[mode] = answer_logprob(engine.prepare(example.question, mode=mode, **ask), answer)
            translated = engine.prepare(example.question, mode="translate", replay=0, refresh=0.0, **ask)
            first = len(translated.fmt.context_prefix_ids())
            chunk = torch.arange(first, translated.next_position - len(translated.fmt.separator_ids()))
            for b in [0.0, *biases]:
                row[f"b{b:+g}"] = biased_logprob(translated, answer, chunk, b)
            rows.append(row)

    none, native = [r["none"] for r in rows], [r["native"] for r in rows]
    summary = {}
    print(f"answer log-prob recovery, n = {len(rows)} (questions {args.start + 1}-{args.start + len(rows)}):")
    for b in [0.0, *biases]:
        col = [r[f"b{b:+g}"] for r in rows]
        rec = recovery(col, none, native)
        diff = recovery_difference(col, [r["b+0"] for r in rows], none, native)
        summary[f"{b:+g}"] = {"recovery": [rec.value, rec.lo, rec.hi], "vs_b0": [diff.value, diff.lo, diff.hi]}
        print(f"  b = {b:+5.2f}: {100 * rec.value:5.1f} % [{100 * rec.lo:.1f}, {100 * rec.hi:.1f}]   "
              f"vs b = 0: {100 * diff.value:+5.1f} [{100 * diff.lo:+.1f}, {100 * diff.hi:+.1f}]")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": args.target, "canonical": args.canonical,
                                              "questions": [args.start, args.start + len(rows)],
                                              "summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
