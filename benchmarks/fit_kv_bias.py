"""Fit a translator's mean K/V error (`kv_bias.safetensors`) on held-out contexts.

Each context goes through the real path (ingest with the canonical model into a temporary
store; the engine's native prefill and its translation of the same chunk, assembled at the
same positions), and `native - translated` is averaged per target layer and KV head, keys
before RoPE (`cagkv.translate.kv_bias`). The translator folder is copied to `--out` and the
offsets are written there with a `kv_bias` record in its card; the translation they are
measured on is the folder's own without any earlier offsets.

Example (E84: PubMedQA abstracts, a domain no evaluation uses):
    python benchmarks/fit_kv_bias.py cagkv/translators/smollm2-135m__gemma3-270m \\
        --dataset ../shared/data/pubmedqa_trainval.jsonl --contexts 100 --out ~/.cache/cagkv/runs/e84/gemma_bias
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cagkv.eval.datasets import load_dataset, unique_contexts
from cagkv.eval.fitting import copy_translator, fit_bench
from cagkv.translate import load_translator
from cagkv.translate.artifact import add_card_record
from cagkv.translate.kv_bias import KV_BIAS_FILE, fit_kv_bias, save_kv_bias


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("translator", help="translator folder")
    ap.add_argument("--dataset", required=True, help="JSONL with a 'context' per line (the eval format)")
    ap.add_argument("--contexts", type=int, default=100, help="distinct contexts to fit on (first chunk of each)")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP distinct contexts of the seeded draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="copy the translator folder here and write the offsets there")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = copy_translator(args.translator, args.out, drop=KV_BIAS_FILE)  # measured on the folder's own translation
    translator = load_translator(out)
    contexts = unique_contexts(load_dataset(args.dataset, seed=args.seed))[args.skip : args.skip + args.contexts]
    with fit_bench(translator, args.dataset, contexts, prefix="bias") as bench:
        bias = fit_kv_bias(bench.engine, bench.target, bench.documents, progress=True)
    save_kv_bias(bias, out)
    record = {"dataset": Path(args.dataset).name, "contexts": len(contexts), "skip": args.skip,
              "seed": args.seed, "tokens": int(bias["tokens"]),
              "key_norm": round(float(bias["keys"].norm(dim=-1).mean()), 4),
              "value_norm": round(float(bias["values"].norm(dim=-1).mean()), 4)}
    add_card_record(out, "kv_bias", record)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
