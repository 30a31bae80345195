"""Held-out probe of an output-space ensemble of translators: is there room for a mixture of
*differently trained* translators?

Every mixture tried so far (E13, E21, E57) had experts trained on the same data with the same
loss, and they gave the answers a single expert gives. Translators of one pair trained with
different recipes (E23, E98, E101, ...) differ more. This script measures, on the held-out
chunks of a pair folder (`Trainer.evaluate`, the same probe `cagkv train` writes into the
card), each translator alone and the plain average of their translated keys and values, per
token and layer (a constant gate of 1/N). A constant gate is one point of what a learned
per-token gate could choose, so an average well above every member says a gated mixture
of these translators has room; an average at the members' mean says it has little.
E104 in docs/EXPERIMENTS.md.

Example:
    python benchmarks/ensemble_probe.py cagkv/translators/smollm2-135m__qwen2.5-0.5b \
        ~/.cache/cagkv/runs/e101/qwen_mixu_t05 \
        --probe ~/.cache/cagkv/pairs/smollm2-135m__qwen2.5-0.5b__7a8b247fa1c6 --probe-chunks 29
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import Any

import torch

from cagkv.translate.artifact import load_translator


def ensemble_translate(trainers: list[Any]):
    """A `translate_batch` that averages the members' keys and values (r = 0 only). The
    members' own methods are bound here, before the caller installs the result on one of them."""
    own = [tr.translate_batch for tr in trainers]

    def translate_batch(bt: dict[str, torch.Tensor]):
        keys, values, out = own[0](bt)
        for member in own[1:]:
            k, v, _ = member(bt)
            keys, values = keys + k, values + v
        return keys / len(own), values / len(own), out

    return translate_batch


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("translators", nargs="+", help="translator folders of one pair (two or more)")
    ap.add_argument("--probe", required=True, help="pair folder with heldout/ (none of the translators trained on it)")
    ap.add_argument("--probe-chunks", type=int, default=29)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args()
    if len(args.translators) < 2:
        raise SystemExit("give at least two translators")

    from cagkv.models import load
    from cagkv.translate.pairs import PairSet
    from cagkv.translate.train import Trainer, TrainConfig

    torch.set_num_threads(1)
    members = [load_translator(os.path.expanduser(p)) for p in args.translators]
    names = {(m.card["source"]["name"], m.card["target"]["name"]) for m in members}
    if len(names) != 1:
        raise SystemExit(f"the translators are for different pairs: {sorted(names)}")
    (src_name, tgt_name), = names
    source, target = load(src_name), load(tgt_name)
    pairs = os.path.expanduser(args.probe)
    train, held = PairSet(f"{pairs}/train"), PairSet(f"{pairs}/heldout")
    cfg = TrainConfig(eval_samples=args.probe_chunks)
    trainers = [Trainer(source, target, train, held, cfg, mot=m.model.train(False)) for m in members]

    results: dict[str, Any] = {}
    for path, tr in zip(args.translators, trainers):
        results[path] = tr.evaluate()
        print(f"{results[path]['answer_ll_recovery']:.4f}  {path}", flush=True)
    groups = [list(c) for n in range(2, len(trainers) + 1) for c in itertools.combinations(range(len(trainers)), n)]
    for group in groups:
        host = trainers[group[0]]
        own = host.translate_batch
        host.translate_batch = ensemble_translate([trainers[i] for i in group])
        for i in group:  # `evaluate` puts only its own translator in eval mode, and back in train mode after
            trainers[i].mot.train(False)
        try:
            key = " + ".join(args.translators[i] for i in group)
            results[key] = host.evaluate()
        finally:
            host.translate_batch = own
        print(f"{results[key]['answer_ll_recovery']:.4f}  average of {key}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
