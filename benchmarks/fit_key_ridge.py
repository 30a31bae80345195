"""Fit a translator's key correction from every source layer (`key_ridge.safetensors`, E108).

On the train chunks of a pair folder (`cagkv train`'s pairs: the source's K/V of every layer,
the target's native keys), the translator's keys are computed as in training and a ridge
regression of their error on all source layers' K/V, aligned to the target tokens, is fitted
per translated target layer (`cagkv.translate.key_ridge`). The translator folder is copied to
`--out` and the correction is written there with a `key_ridge` record in its card. The
held-out chunks of the same folder are then probed (`Trainer.evaluate`, the probe `cagkv
train` writes into the card) with and without the correction.

Example (E108, SmolLM2 -> Qwen2.5):
    python benchmarks/fit_key_ridge.py cagkv/translators/smollm2-135m__qwen2.5-0.5b \\
        --pairs ~/.cache/cagkv/pairs/smollm2-135m__qwen2.5-0.5b__7a8b247fa1c6 --out ~/.cache/cagkv/runs/e108/qwen_ridge
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from cagkv.eval.fitting import copy_translator
from cagkv.translate import load_translator
from cagkv.translate.artifact import add_card_record
from cagkv.translate.key_ridge import (
    KEY_RIDGE_FILE,
    RidgeAccumulator,
    apply_key_ridge,
    fit_key_ridge,
    load_key_ridge,
    ridge_features,
    save_key_ridge,
)


def corrected(trainer: Any, ridge: dict[str, torch.Tensor], source_layers: list[int]) -> None:
    """Make `trainer.batch` / `translate_batch` (one chunk per batch, as the probe runs) add
    the correction to the translated keys."""
    batch, translate = trainer.batch, trainer.translate_batch

    def batch_with_features(recs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if len(recs) != 1:
            raise ValueError("the corrected probe runs one chunk per batch")
        bt = batch(recs)
        r = recs[0]
        bt["ridge_features"] = ridge_features(r["src_k"], r["src_v"], r["src_off"], r["tgt_off"], source_layers)
        return bt

    def translate_corrected(bt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        keys, values, out = translate(bt)
        fixed = apply_key_ridge(keys[0], bt["ridge_features"], ridge)
        return torch.cat([fixed[None], keys[1:]]), values, out

    trainer.batch, trainer.translate_batch = batch_with_features, translate_corrected


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("translator", help="translator folder")
    ap.add_argument("--pairs", required=True, help="pair folder with train/ and heldout/ of this translator's pair")
    ap.add_argument("--out", required=True, help="copy the translator folder here and write the correction there")
    ap.add_argument("--lam", type=float, default=0.1, help="ridge strength, times the mean diagonal of the "
                    "standardised Gram matrix (E108b chose 0.1 on validation chunks)")
    ap.add_argument("--rank", type=int, default=0, help="keep this many singular directions (0: all)")
    ap.add_argument("--with-mean", action="store_true", help="also add the mean key error (E84's offset)")
    ap.add_argument("--chunks", type=int, default=0, help="fit on the first CHUNKS train chunks (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from cagkv.models import load
    from cagkv.translate.pairs import PairSet
    from cagkv.translate.train import TrainConfig, Trainer

    torch.set_num_threads(args.threads)
    t0 = time.time()
    out = copy_translator(args.translator, args.out, drop=KEY_RIDGE_FILE)  # fitted on the folder's own keys
    translator = load_translator(out)
    source, target = load(translator.card["source"]["name"]), load(translator.card["target"]["name"])
    pairs = os.path.expanduser(args.pairs)
    train, held = PairSet(f"{pairs}/train"), PairSet(f"{pairs}/heldout")
    trainer = Trainer(source, target, train, held, TrainConfig(eval_samples=len(held)),
                      mot=translator.model.train(False))
    cfg = trainer.mot.cfg
    source_layers = list(range(cfg.src_layers))
    acc, buffer = RidgeAccumulator(), []
    chunks = min(len(train), args.chunks or len(train))
    for i in range(chunks):
        rec = train[i]
        bt = trainer.batch([rec])
        keys, _, _ = trainer.translate_batch(bt)
        n = int(rec["tgt_ids"].numel())
        translated = keys[0, :, :, :n].permute(2, 0, 1, 3).reshape(n, cfg.tgt_layers, -1)  # [T, L, H*D]
        native = bt["tk"][0, :, :n].transpose(0, 1)  # the batch's native keys, the same layout
        buffer.append((ridge_features(rec["src_k"], rec["src_v"], rec["src_off"], rec["tgt_off"], source_layers),
                       native - translated))
        if len(buffer) == 32 or i == chunks - 1:  # one float32 product per 32 chunks
            acc.add(torch.cat([f for f, _ in buffer]), torch.cat([e for _, e in buffer]))
            buffer = []
    save_key_ridge(fit_key_ridge(acc, cfg.translated, lam=args.lam, rank=args.rank, with_mean=args.with_mean),
                   out, source_layers)
    ridge = load_key_ridge(out, cfg.src_layers, cfg.src_kv_dim, cfg.tgt_layers, cfg.tgt_kv_heads * cfg.tgt_head_dim)
    assert ridge is not None  # probed as saved (float16 factors)
    print(f"fitted on {chunks} chunks ({acc.n} tokens) in {time.time() - t0:.0f} s", flush=True)

    probe = {"without": trainer.evaluate()}
    corrected(trainer, ridge, source_layers)
    probe["with"] = trainer.evaluate()
    record = {"pairs": pairs, "chunks": chunks, "tokens": acc.n, "lam": args.lam, "rank": args.rank,
              "with_mean": args.with_mean, "layers": cfg.translated,
              "probe": {name: {k: round(v, 4) for k, v in r.items() if isinstance(v, float)} for name, r in probe.items()}}
    add_card_record(out, "key_ridge", record)
    print(json.dumps(record["probe"]), f"{time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
