"""Share of an eval set's context tokens that a difficulty table never saw (E70, E81).

Tokenizes the distinct contexts of the questions `cagkv eval --dataset D --limit N --seed S`
runs on with the table's target model and counts the tokens whose id has count 0 in each
table. Example (E81):
    python benchmarks/unseen_share.py --target smollm2-135m \\
        cagkv/translators/gemma3-270m__smollm2-135m ~/.cache/cagkv/runs/e81/rev_difficulty
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file

from cagkv.eval.datasets import load_dataset
from cagkv.models import load
from cagkv.translate.difficulty import DIFFICULTY_FILE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("translators", nargs="+", help="translator folders, each with a difficulty table")
    ap.add_argument("--target", required=True, help="the tables' target model (its tokenizer)")
    ap.add_argument("--dataset", default="../shared/data/squad_v1.1_dev_even_articles.jsonl")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = load(args.target).tokenizer
    contexts = {e.context for e in load_dataset(args.dataset, args.limit, args.seed)}
    ids = [i for c in sorted(contexts) for i in tokenizer(c, add_special_tokens=False)["input_ids"]]
    print(f"{len(contexts)} contexts, {len(ids)} tokens")
    for folder in args.translators:
        count = load_file(str(Path(folder).expanduser() / DIFFICULTY_FILE))["count"]
        unseen = sum(1 for i in ids if count[i] == 0)
        print(f"{folder}: ids seen {int((count > 0).sum())}, tokens {int(count.sum())}, "
              f"unseen share {unseen / len(ids):.3f}")


if __name__ == "__main__":
    main()
