"""Fit a translator's difficulty table (expected K/V error per target token id) on paired chunks.

Runs the translator over every chunk of a pair folder's `train/` split (what `cagkv train`
built: the source's K/V and the target's own), measures each token's translation error
(`cagkv.translate.difficulty.token_errors`) and averages it per target token id. The table
lands beside the weights as `difficulty.safetensors`; refresh's "difficulty",
"contrast_difficulty", "union" and "adaptive" scorings read it. With `--out` the translator folder is copied there
first (the shipped folder stays as it is).
The card's `difficulty` record is rewritten for the new table; of the former record only
`adaptive`'s tuned switch threshold (`peak_z`, E77) is kept.

Several pair folders pool their chunks. Example (E69, the reverse pair; E70 added `--prior`):
    python benchmarks/fit_difficulty.py cagkv/translators/gemma3-270m__smollm2-135m \\
        ~/.cache/cagkv/pairs/gemma3-270m__smollm2-135m__9fe7061cd069 --out ~/.cache/cagkv/runs/e69/rev_difficulty
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cagkv.eval.fitting import copy_translator
from cagkv.models import load
from cagkv.translate import load_translator
from cagkv.translate.artifact import add_card_record
from cagkv.translate.difficulty import DIFFICULTY_FILE, PRIORS, card_record, fit_difficulty, save_difficulty
from cagkv.translate.pairs import PairSet
from cagkv.translate.train import Trainer, TrainConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("translator", help="translator folder")
    ap.add_argument("pairs", nargs="+", help="pair folders (with train/) for this translator's source and target")
    ap.add_argument("--prior", choices=PRIORS, default="singletons",
                    help="what rare and unseen ids are shrunk towards: the ids seen once (default) or the mean (E69)")
    ap.add_argument("--out", default="", help="copy the translator folder here and write the table there")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.translator)
    if args.out:
        folder = copy_translator(folder, args.out, drop=DIFFICULTY_FILE)
    translator = load_translator(folder)
    card = translator.card
    source, target = load(card["source"]["name"]), load(card["target"]["name"])
    folders = [Path(p).expanduser() for p in args.pairs]
    sets = [PairSet(f / "train") for f in folders]
    heldout = PairSet(folders[0] / "heldout")
    trainer = Trainer(source, target, sets[0], heldout, TrainConfig(), mot=translator.model.train(False))
    table = fit_difficulty(trainer, sets, progress=True, prior=args.prior)
    path = save_difficulty(table, folder)
    record = card_record(table, [str(f) for f in folders], sum(len(s) for s in sets), args.prior,
                         previous=card.get("difficulty"))
    add_card_record(folder, "difficulty", record)
    print(f"{path}: {record['ids_seen']} token ids seen in {record['tokens']} tokens; "
          f"difficulty of seen ids in {record['range_seen']} (min, max)")


if __name__ == "__main__":
    main()
