"""How far is each translated layer's attention from native, and what key scale brings it nearest?

For a translator and a pair folder (`cagkv train` writes them under
$CAGKV_HOME/pairs/SRC__TGT__KEY/{train,heldout}), per translated target layer, over the
stored continuations' native queries:
- the slope and squared correlation of native attention logits on translated ones (each
  query's row centred over the chunk keys): slope < 1 with a high correlation means the
  translated keys draw too sharp an attention, > 1 too flat;
- the attention KL (native || translated, over prefix + chunk) with the translated keys
  multiplied by each factor of a grid, and the factor that minimises it.

With `--write DIR` it saves a copy of the translator with those factors as its key scales
(`MoTConfig.key_scale`), a calibration fitted on the pair folder's split, never on the
evaluation data. E36 in docs/EXPERIMENTS.md.

Example:
    python benchmarks/key_scale_grid.py --canonical smollm2-135m --target gemma3-270m \
        --translator cagkv/translators/smollm2-135m__gemma3-270m \
        --pairs ~/.cache/cagkv/pairs/smollm2-135m__gemma3-270m__048fd8aedb48 --split train --limit 40 \
        --out docs/results/key_scale_grid_gemma3.json --write ~/.cache/cagkv/runs/e36/grid_gemma3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Any

import torch

from cagkv.models import load
from cagkv.translate.artifact import load_translator, save_artifact
from cagkv.translate.pairs import PairSet
from cagkv.translate.runner import start_from_artifact
from cagkv.translate.train import Trainer, TrainConfig

GRID = (0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0)


@torch.no_grad()
def layer_statistics(tr: Trainer, records: PairSet, limit: int, grid: tuple[float, ...]) -> dict[str, Any]:
    """Slope, squared correlation and attention KL per factor, per translated layer."""
    cfg = tr.mot.cfg
    n_tr = len(cfg.translated)
    cross, var_tr, var_nat = torch.zeros(n_tr), torch.zeros(n_tr), torch.zeros(n_tr)
    kl, count = torch.zeros(n_tr, len(grid)), 0
    for i in range(min(limit, len(records))):
        rec = records[i]
        keys, _, _ = tr.translate_batch(tr.batch([rec]))
        n = int(rec["tgt_ids"].numel())
        for j in range(len(rec["kinds"])):
            q_all = rec[f"c{j}_q"].float()  # [L, Hq, C, D], RoPE applied
            for li, layer in enumerate(cfg.translated):
                s_nat = tr.prefix_chunk_scores(q_all[layer], rec["tgt_k"][layer].float(), layer)
                lp_nat = torch.log_softmax(s_nat, -1)
                for gi, factor in enumerate(grid):
                    s_tr = tr.prefix_chunk_scores(q_all[layer], factor * keys[0, layer, :, :n], layer)
                    kl[li, gi] += (lp_nat.exp() * (lp_nat - torch.log_softmax(s_tr, -1))).sum(-1).mean()
                    if factor == 1.0:
                        cn = s_nat[..., tr.P :] - s_nat[..., tr.P :].mean(-1, keepdim=True)
                        ct = s_tr[..., tr.P :] - s_tr[..., tr.P :].mean(-1, keepdim=True)
                        cross[li] += (cn * ct).sum()
                        var_tr[li] += (ct * ct).sum()
                        var_nat[li] += (cn * cn).sum()
            count += 1
    kl /= max(count, 1)
    best = [grid[int(row.argmin())] for row in kl]
    return {
        "layers": list(cfg.translated), "continuations": count, "grid": list(grid),
        "slope_native_on_translated": [round(float(x), 3) for x in cross / var_tr.clamp(min=1e-12)],
        "corr2": [round(float(x), 3) for x in cross ** 2 / (var_tr * var_nat).clamp(min=1e-12)],
        "attention_kl": [[round(float(x), 4) for x in row] for row in kl],
        "best_factor": best,
        "kl_at_1": [round(float(row[grid.index(1.0)]), 4) for row in kl],
        "kl_at_best": [round(float(row.min()), 4) for row in kl],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--canonical", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--translator", required=True)
    ap.add_argument("--pairs", required=True, help="pair folder (with train/ and heldout/)")
    ap.add_argument("--split", default="train", choices=("train", "heldout"))
    ap.add_argument("--limit", type=int, default=40, help="chunks scored")
    ap.add_argument("--out", default="", help="write the numbers as JSON here")
    ap.add_argument("--write", default="", help="save a copy of the translator with the best factors as key scales")
    args = ap.parse_args()
    torch.set_num_threads(1)
    source, target = load(args.canonical), load(args.target)
    model = load_translator(args.translator).model
    pairs = os.path.expanduser(args.pairs)
    records = PairSet(f"{pairs}/{args.split}")
    tr = Trainer(source, target, PairSet(f"{pairs}/train"), records, TrainConfig(), mot=model)
    res = layer_statistics(tr, records, args.limit, GRID)
    res.update(translator=args.translator, pairs=args.pairs, split=args.split)
    print(json.dumps({k: res[k] for k in ("layers", "slope_native_on_translated", "corr2", "best_factor",
                                         "kl_at_1", "kl_at_best")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.write:
        mot, _, card = start_from_artifact(args.translator, source, target,
                                           dataclasses.replace(model.cfg, key_scale=True))
        with torch.no_grad():
            for layer, factor in zip(res["layers"], res["best_factor"]):
                mot.key_log_scale[layer] = math.log(factor)
        card = dict(card, key_scale_from={"method": "benchmarks/key_scale_grid.py", "translator": args.translator,
                                          "pairs": args.pairs, "split": args.split, "limit": args.limit})
        int8 = "int8" in str(card.get("weights_dtype", ""))
        print("wrote", save_artifact(os.path.expanduser(args.write), mot, card, int8_linear=int8))


if __name__ == "__main__":
    main()
