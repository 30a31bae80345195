"""Which parts of a translator's keys cost the answers? A probe on held-out training pairs.

Two diagnostics over the held-out chunks of a pair folder (`cagkv train` writes them under
$CAGKV_HOME/pairs/SRC__TGT__KEY/heldout; each continuation scored as in the training probe):

1. Native keys swapped in for some RoPE frequency pairs: every channel, the 1/8 and 1/4 of
   the pairs that hold the most query energy (per layer and KV head, from the training
   pairs' stored queries), and the other 3/4. Answer log-prob recovery and continuation KL.
2. Keys and values from the translator's linear path alone or from the whole translator,
   crossed; plus the key-logit error of `Trainer.key_logit_loss` (within-chunk, weighted
   by query energy), per layer, with and without the weighting.

Example (E35's diagnostics, on E34q's pairs):
    python benchmarks/key_channels.py --canonical smollm2-135m --target qwen2.5-0.5b \
        --translator cagkv/translators/smollm2-135m__qwen2.5-0.5b \
        --pairs ~/.cache/cagkv/pairs/smollm2-135m__qwen2.5-0.5b__4dc7c6945a01 --limit 25
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from cagkv.models import load
from cagkv.translate.artifact import load_translator
from cagkv.translate.pairs import PairSet
from cagkv.translate.train import Trainer, TrainConfig
from cagkv.translate.translator import assemble_kv


class ProbeTrainer(Trainer):
    """A Trainer whose translation can take native keys in some channels (`native_mask`
    `[L, H, D]`) and keys / values from the linear path alone (`k_from` / `v_from`)."""

    native_mask: torch.Tensor | None = None
    k_from, v_from = "full", "full"

    def translate_batch(self, bt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        with torch.no_grad():
            emb = self.ts.embed(bt["ids"]).float()
        out = self.mot(bt["src"], emb, bt["mask"])
        if "linear" in (self.k_from, self.v_from):
            lin, kv = self.mot.skip(self.mot.normalise_source(bt["src"]), emb), self.mot.cfg.tgt_kv_dim
            k_part = lin if self.k_from == "linear" else out.y
            v_part = lin if self.v_from == "linear" else out.y
            out.y = torch.cat([k_part[..., :kv], v_part[..., kv:]], -1)
        keys, values = assemble_kv(self.mot, self.ts, out, emb)
        if self.native_mask is not None:
            keys = torch.where(self.native_mask[None, :, :, None, :], self.native_keys(bt), keys)
        return keys, values, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--canonical", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--translator", required=True)
    ap.add_argument("--pairs", required=True, help="pair folder (with train/ and heldout/)")
    ap.add_argument("--limit", type=int, default=25, help="held-out chunks scored")
    ap.add_argument("--out", default="", help="write the numbers as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    source, target = load(args.canonical), load(args.target)
    model = load_translator(args.translator).model
    pairs = os.path.expanduser(args.pairs)
    train, held = PairSet(f"{pairs}/train"), PairSet(f"{pairs}/heldout")
    tr = ProbeTrainer(source, target, train, held, TrainConfig(eval_samples=args.limit, key_logit_weight=1.0),
                      mot=model)
    cfg = model.cfg
    L, H, D = cfg.tgt_layers, cfg.tgt_kv_heads, cfg.tgt_head_dim
    w = tr.key_logit_weights()  # [L, H, D], one value per RoPE pair in both of its channels
    energy = w[..., : D // 2]
    top = energy.sort(-1, descending=True).values.cumsum(-1) / energy.sum(-1, keepdim=True)
    res: dict[str, Any] = {"query_energy_share": {
        "top_1/8_pairs": round(float(top[..., D // 16 - 1].mean()), 3),
        "top_1/4_pairs": round(float(top[..., D // 8 - 1].mean()), 3)}}
    print("query energy held by the top 1/8 and 1/4 of RoPE pairs:", res["query_energy_share"], flush=True)
    rank = energy.argsort(-1, descending=True)  # [L, H, D/2]

    def mask(pairs_sel: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(L, H, D // 2, dtype=torch.bool).scatter_(-1, pairs_sel, True)
        m = torch.cat([m, m], -1)
        m[cfg.exact_layers] = False
        return m

    rows = [("translated", None), ("native keys, every channel", mask(rank)),
            ("native keys, top 1/8 pairs", mask(rank[..., : D // 16])),
            ("native keys, top 1/4 pairs", mask(rank[..., : D // 8])),
            ("native keys, other 3/4 pairs", mask(rank[..., D // 8 :]))]
    res["swaps"] = {}
    for name, m in rows:
        tr.native_mask = m
        r = tr.evaluate()
        res["swaps"][name] = {"answer_ll_recovery": r["answer_ll_recovery"], "continuation_kl": r["continuation_kl"]}
        print(f"{name}: recovery {r['answer_ll_recovery']}, KL {r['continuation_kl']}", flush=True)
    tr.native_mask = None
    res["linear"] = {}
    for kf, vf in [("linear", "full"), ("linear", "linear"), ("full", "linear")]:
        tr.k_from, tr.v_from = kf, vf
        r = tr.evaluate()
        res["linear"][f"K {kf}, V {vf}"] = {k: r[k] for k in ("answer_ll_recovery", "continuation_kl",
                                                           "r2_mean_translated", "key_logit_rel_error")}
        print(f"K {kf}, V {vf}:", res["linear"][f"K {kf}, V {vf}"], flush=True)
    tr.k_from, tr.v_from = "full", "full"
    # the translated keys' within-chunk error by layer (exact layers 0), plain and weighted by query energy
    err, err_w, spread, spread_w = (torch.zeros(L) for _ in range(4))
    idx = cfg.translated
    with torch.no_grad():
        for i in range(min(args.limit, len(held))):
            bt = tr.batch([held[i]])
            keys, _, _ = tr.translate_batch(bt)
            for e, s, weights in ((err, spread, torch.ones_like(w)), (err_w, spread_w, w)):
                de, ds = tr.key_logit_errors(keys, bt, weights)
                e[idx] += de
                s[idx] += ds
    res["key_error_share_by_layer"] = [round(float(x), 3) for x in err / spread.clamp(min=1e-8)]
    res["key_error_share_by_layer_query_weighted"] = [round(float(x), 3) for x in err_w / spread_w.clamp(min=1e-8)]
    print("within-chunk key error / spread by layer:", res["key_error_share_by_layer"])
    print("the same, weighted by query energy:     ", res["key_error_share_by_layer_query_weighted"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
