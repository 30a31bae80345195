"""Write a translator whose weights lie between two of the same shape: (1 - t) * A + t * B.

A continuation of a shipped translator (`cagkv train --init A`) starts at A's weights, so
the two lie in one basin and their interpolation is a meaningful translator (weight-space
ensembling, as in WiSE-FT). If a point between them beats both, the continuation moved in a
useful direction and overshot; if quality falls monotonically from A, it moved the wrong way.
Normalisation statistics and integer buffers are A's (they must agree, and are checked).
E37 in docs/EXPERIMENTS.md.

A may have one expert per group where B, a continuation grown from it (`--init A --experts
N`), has N: A is then read as its upcycled form (its expert copied N times, under B's router,
which does not change what A computes), so the two share one shape (E57). Likewise B may
read the target's residual stream (`native_below`, E66) where A does not: A is read with that
projection at zero, where B's training started.

With `--probe PAIRS` (a pair folder with heldout/) the card's held-out quality is measured
again for the new weights, as `cagkv train` measures it (`Trainer.evaluate`), so `auto`'s
threshold reads the translator it guards, not A.

Example:
    python benchmarks/interpolate_translators.py cagkv/translators/smollm2-135m__gemma3-270m \
        ~/.cache/cagkv/runs/e35g_gemma_keylogit --t 0.5 --out ~/.cache/cagkv/runs/e37/gemma_t05 \
        --probe ~/.cache/cagkv/pairs/smollm2-135m__gemma3-270m__048fd8aedb48
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import torch

from cagkv.translate.artifact import load_translator, save_artifact
from cagkv.translate.mot import MoTTranslator, grown_state


@torch.no_grad()
def interpolate(a: torch.nn.Module, b: torch.nn.Module, t: float) -> dict[str, torch.Tensor]:
    """State dict `(1 - t) * a + t * b` over floating-point parameters; buffers must match."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        raise ValueError(f"the translators differ in tensors: {sorted(sa.keys() ^ sb.keys())[:3]}")
    params = {name for name, _ in a.named_parameters()}
    out = {}
    for name, va in sa.items():
        vb = sb[name]
        if va.shape != vb.shape:
            raise ValueError(f"{name}: {tuple(va.shape)} vs {tuple(vb.shape)}")
        if name in params and va.is_floating_point():
            out[name] = torch.lerp(va, vb, t)
        elif not torch.allclose(va.float(), vb.float(), rtol=1e-3, atol=1e-5):
            raise ValueError(f"buffer {name} differs between the two translators")
        else:
            out[name] = va
    return out


def upcycled_like(a: MoTTranslator, b: MoTTranslator) -> MoTTranslator:
    """`a` in `b`'s shape, computing what `a` computes: one expert per group copied into all of
    `b`'s (under `b`'s routers), and/or `b`'s projection of the target's residual stream
    (`native_below`, E66) at zero, as a continuation given one starts."""
    cfg_a, cfg_b = a.cfg, b.cfg
    grows_experts = cfg_a.experts != cfg_b.experts
    same_rest = dataclasses.replace(cfg_b, experts=cfg_a.experts, top_k=cfg_a.top_k,
                                    native_below=cfg_a.native_below) == cfg_a
    if not same_rest or (grows_experts and cfg_a.experts != 1) or cfg_a.native_below not in (0, cfg_b.native_below):
        raise ValueError("the two translators have different configs (beyond A's one expert grown to B's several, "
                         "or B's native_below)")
    grown = MoTTranslator(cfg_b)
    state = grown_state(grown, a.state_dict())
    if grows_experts:
        state.update({name: v for name, v in b.state_dict().items() if ".router." in f".{name}"})
    missing, _ = grown.load_state_dict(state, strict=False)
    if set(missing) - {"res_proj"}:
        raise ValueError(f"A's weights do not fill B's shape: {sorted(missing)[:3]}")
    if "res_proj" in missing:
        with torch.no_grad():
            grown.res_proj.zero_()
    return grown.train(False)


def probe_quality(translator: Any, pairs: str, chunks: int) -> dict[str, Any]:
    """The card's `quality` and `metrics` for `translator`'s weights on the held-out chunks of `pairs`."""
    from cagkv.models import load
    from cagkv.translate.pairs import PairSet
    from cagkv.translate.train import Trainer, TrainConfig

    torch.set_num_threads(1)
    card = translator.card
    source, target = load(card["source"]["name"]), load(card["target"]["name"])
    held = PairSet(f"{pairs}/heldout")
    mot = translator.model.train(False)
    tr = Trainer(source, target, PairSet(f"{pairs}/train"), held, TrainConfig(eval_samples=chunks), mot=mot)
    r = tr.evaluate()
    quality = dict(card.get("quality") or {}, metric="answer_ll_recovery", value=r["answer_ll_recovery"],
                   note=f"held-out answers of {pairs} ({r['heldout_chunks']} chunks), measured on these weights")
    return {"quality": quality, "metrics": dict(card.get("metrics") or {}, interpolated=r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="translator folder A (t = 0)")
    ap.add_argument("b", help="translator folder B (t = 1), same config as A")
    ap.add_argument("--t", type=float, required=True, help="position between A (0) and B (1)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--probe", default="", help="pair folder whose held-out chunks measure the card's quality")
    ap.add_argument("--probe-chunks", type=int, default=10)
    args = ap.parse_args()
    a, b = load_translator(os.path.expanduser(args.a)), load_translator(os.path.expanduser(args.b))
    if a.model.cfg != b.model.cfg:
        try:
            a.model = upcycled_like(a.model, b.model)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    a.model.load_state_dict(interpolate(a.model, b.model, args.t))
    card = dict(a.card, interpolated={"a": args.a, "b": args.b, "t": args.t})
    if args.probe:
        card.update(probe_quality(a, os.path.expanduser(args.probe), args.probe_chunks))
    int8 = "int8" in str(a.card.get("weights_dtype", ""))
    print("wrote", save_artifact(os.path.expanduser(args.out), a.model, card, int8_linear=int8))


if __name__ == "__main__":
    main()
