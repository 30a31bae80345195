"""Fit a translator's attention bias per target layer and head to native's attention shares (`attention_bias_fit.safetensors`).

Each question goes through the real path (its context ingested with the canonical model into
a temporary store; the engine's native prefill and its translation at r = 0 of the first
retrieved chunk, assembled at the same positions). Per layer and head, the share of the
question's attention on the translated chunk is matched to native's in `--rounds` rounds
(`cagkv.translate.attention_fit`). The translator folder is copied to `--out`, the table is
written there with an `attention_fit` record in its card; the bias scope word "fitted"
(`--modes NAME=DIR@0+bias1+fitted`, `cagkv ask --attention-bias 1 --attention-bias-scope fitted`)
then applies it.

Example (E95: 100 Natural Questions with their oracle passages, a dataset no decision uses):
    python benchmarks/fit_attention_bias.py cagkv/translators/smollm2-135m__qwen2.5-0.5b \\
        --dataset ../shared/data/nq_open_oracle_even.jsonl --questions 100 --out ~/.cache/cagkv/runs/e95/qwen_fit
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from cagkv.eval.datasets import load_dataset
from cagkv.eval.fitting import copy_translator, fit_bench
from cagkv.translate import load_translator
from cagkv.translate.artifact import add_card_record
from cagkv.translate.attention_fit import ATTENTION_FIT_FILE, Fed, FitCase, fit_attention_bias, save_attention_fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("translator", help="translator folder")
    ap.add_argument("--dataset", required=True, help="JSONL of questions with their context (the eval format)")
    ap.add_argument("--questions", type=int, default=100, help="questions to fit on (first chunk of each context)")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP questions of the seeded draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of measuring the shares and adding the gap left")
    ap.add_argument("--out", required=True, help="copy the translator folder here and write the table there")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (logs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = copy_translator(args.translator, args.out, drop=ATTENTION_FIT_FILE)  # nothing of an earlier fit measured
    translator = load_translator(out)
    examples = load_dataset(args.dataset, limit=args.skip + args.questions, seed=args.seed)[args.skip:]
    cases = []
    with fit_bench(translator, args.dataset, [e.context for e in examples], prefix="fit",
                   progress=not args.no_progress) as bench:
        for example, document in tqdm(list(zip(examples, bench.documents)), desc="caches", disable=args.no_progress):
            ask = dict(target=bench.target, document_ids=[document], top_k=1)
            native = bench.engine.prepare(example.question, mode="native", **ask)
            # a bias scoped "all" names the translated positions exactly as the engine biases them
            translated = bench.engine.prepare(example.question, mode="translate", replay=0, refresh=0.0,
                                              attention_bias=1.0, attention_bias_scope="all", **ask)
            if translated.bias is None or translated.stale:
                raise SystemExit(f"{example.id}: no translated chunk to fit on")
            case = FitCase(native.target.model, Fed(native.cache, native.next_position, list(native.prompt_ids)),
                           Fed(translated.cache, translated.next_position, list(translated.prompt_ids)),
                           translated.bias.positions)
            case.question_tokens  # noqa: B018 - the two layouts must agree (ValueError otherwise)
            cases.append(case)
        fit = fit_attention_bias(cases, rounds=args.rounds, progress=not args.no_progress)
    save_attention_fit(fit, out)
    gap = {k: round(float((fit[k] - fit["native"]).abs().mean()), 4) for k in ("translated", "fitted")}
    record = {
        "dataset": Path(args.dataset).name, "questions": len(cases), "skip": args.skip, "seed": args.seed,
        "rounds": args.rounds, "native_share": round(float(fit["native"].mean()), 4),
        "translated_share": round(float(fit["translated"].mean()), 4),
        "fitted_share": round(float(fit["fitted"].mean()), 4), "mean_abs_share_gap": gap,
        "bias_mean": round(float(fit["bias"].mean()), 4), "bias_abs_mean": round(float(fit["bias"].abs().mean()), 4),
        "how": "benchmarks/fit_attention_bias.py (docs/EXPERIMENTS.md E95)"}
    add_card_record(out, "attention_fit", record)
    per_layer = [round(float(x), 3) for x in fit["bias"].mean(1)]
    print(json.dumps({**record, "bias_by_layer": per_layer}, indent=1))


if __name__ == "__main__":
    main()
