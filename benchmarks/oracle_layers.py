"""Where does a translated cache lose the answer? Swap native K/V into it, layer set by layer set.

For each question the target's cache is prepared twice over the same retrieved chunk, both
in the layout of a translated cache (each chunk on its own, at the same positions):
translated (`--translator`, replay 0) and recomputed by the target itself (replay L, every
layer from its own embeddings: what a perfect translation would give, row `chunk_native`).
So any set of layers can be taken from the one and the rest from the other. Scoring the gold answer over each such
hybrid gives the answer log-prob recovery the translation would reach if those layers were
perfect: the share of the gap that the translation error of those layers costs.

Hybrids (`--splits`, default all): `g<i>` one translator layer group native; `low<f>` /
`high<f>` the lowest / highest fraction f of the layers native; `K` / `V` every layer's keys
/ values native; `l5+11` / `k5+11` / `v5+11` the K/V, keys or values of the named layers
native (any layer set); token sets, every layer's K and V native at a third of the chunk's
tokens (`--token-splits`): `tfirst` / `tlast` the first / last third, `tq` the third the
question attends to most over the translated cache (known at question time), `tqn` the
same chosen over the native cache (an oracle choice), `terr` the third whose translated K/V
are furthest from native (summed over layers, each layer's squared error over its native
mean square; an oracle), `tqerr` that error times the question's attention (an oracle). Prints a table and writes per-question rows plus recoveries with paired
bootstrap intervals (`--out`).

Example (the same 300 SQuAD questions and store as docs/results/squad300_smollm2_qwen25.json):
    python benchmarks/oracle_layers.py --canonical smollm2-135m --target qwen2.5-0.5b \
        --translator cagkv/translators/smollm2-135m__qwen2.5-0.5b --limit 300 --threads 1 \
        --store ~/.cache/cagkv/runs/pareto300/store --out docs/results/oracle_layers_qwen25.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import torch

from cagkv.eval.datasets import load_dataset
from cagkv.eval.metrics import recovery, recovery_difference
from cagkv.eval.runner import (
    EvalConfig,
    ModeRunner,
    default_engine_factory,
    default_store_factory,
    answer_logprob,
    ingest_contexts,
)
from cagkv.refresh import question_attention, top_positions
from cagkv.translate import load_translator

FRACTIONS = (1 / 3, 2 / 3)


def hybrid_splits(groups: list[list[int]], n_layers: int) -> dict[str, tuple[list[int], str]]:
    """name -> (target layers taken from the native cache, which part: "kv" | "k" | "v")."""
    out: dict[str, tuple[list[int], str]] = {}
    for i, layers in enumerate(groups):
        out[f"g{i}"] = (list(layers), "kv")
    for f in FRACTIONS:
        cut = round(n_layers * f)
        out[f"low{f:.2f}"] = (list(range(cut)), "kv")
        out[f"high{f:.2f}"] = (list(range(n_layers - cut, n_layers)), "kv")
    out["K"] = (list(range(n_layers)), "k")
    out["V"] = (list(range(n_layers)), "v")
    return out


def layer_set_split(name: str, n_layers: int) -> tuple[list[int], str] | None:
    """`l5+11` -> ([5, 11], "kv"); `k5` -> ([5], "k"); `v…` values; None if `name` is not of that form."""
    m = re.fullmatch(r"([lkv])(\d+(?:\+\d+)*)", name)
    if m is None:
        return None
    layers = sorted({int(x) for x in m.group(2).split("+")})
    if layers[-1] >= n_layers:
        raise ValueError(f"split {name!r}: the target has layers 0..{n_layers - 1}")
    return layers, {"l": "kv", "k": "k", "v": "v"}[m.group(1)]


def hybrid(translated: Any, native: Any, layers: list[int], part: str) -> Any:
    """A copy of the `translated` prepared cache with `layers`' keys and/or values from `native`."""
    out = copy.copy(translated)
    out.cache = copy.deepcopy(translated.cache)
    for layer in layers:
        dst, src = out.cache.layers[layer], native.cache.layers[layer]
        if dst.keys.shape != src.keys.shape:
            raise ValueError(f"layer {layer}: native {tuple(src.keys.shape)} vs translated {tuple(dst.keys.shape)}")
        if "k" in part:
            dst.keys = src.keys.clone()
        if "v" in part:
            dst.values = src.values.clone()
    return out


TOKEN_SPLITS = ("tfirst", "tlast", "tq", "tqn", "terr", "tqerr")


def translation_error(translated: Any, native: Any, start: int) -> torch.Tensor:
    """Per chunk position (from `start`): the translated K and V's squared error against native,
    each layer's error over the mean native squared norm of its chunk tokens, summed over layers."""
    end = translated.next_position
    total = torch.zeros(end - start)
    for tr_layer, nat_layer in zip(translated.cache.layers, native.cache.layers):
        for tr, nat in ((tr_layer.keys, nat_layer.keys), (tr_layer.values, nat_layer.values)):
            nat_chunk = nat[0, :, start:end].float()
            error = (tr[0, :, start:end].float() - nat_chunk).pow(2).sum(dim=(0, 2))
            total += error / nat_chunk.pow(2).sum(dim=(0, 2)).mean()
    return total


def token_positions(split: str, translated: Any, native: Any, start: int, fraction: float) -> list[int]:
    """The chunk positions (from `start`, the prefix's end) that `split` takes from the native cache."""
    end = translated.next_position
    count = max(1, round((end - start) * fraction))  # as top_positions counts
    if split == "tfirst":
        return list(range(start, start + count))
    if split == "tlast":
        return list(range(end - count, end))
    if split in ("terr", "tqerr"):
        score = torch.zeros(end)
        score[start:] = translation_error(translated, native, start)
        if split == "tqerr":  # error where the question reads
            score *= question_attention(translated.target.model, translated.cache, end, translated.prompt_ids)
        return top_positions(score, range(start, end), fraction)
    chooser = translated if split == "tq" else native
    mass = question_attention(chooser.target.model, chooser.cache, chooser.next_position, chooser.prompt_ids)
    return top_positions(mass, range(start, end), fraction)


def token_hybrid(translated: Any, native: Any, positions: list[int]) -> Any:
    """A copy of `translated` with every layer's K/V at `positions` from `native`."""
    out = copy.copy(translated)
    out.cache = copy.deepcopy(translated.cache)
    index = torch.tensor(positions)
    for dst, src in zip(out.cache.layers, native.cache.layers):
        if dst.keys.shape != src.keys.shape:
            raise ValueError(f"native {tuple(src.keys.shape)} vs translated {tuple(dst.keys.shape)}")
        dst.keys[:, :, index] = src.keys[:, :, index]
        dst.values[:, :, index] = src.values[:, :, index]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--canonical", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--translator", required=True, help="translator folder (scored at replay 0)")
    p.add_argument("--dataset", default="../shared/data/squad_v1.1_dev_even_articles.jsonl")
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", default=None, help="eval store folder to reuse (as `cagkv eval --store`)")
    p.add_argument("--splits", default="", help="comma-separated hybrid names (default: all; `none`: token sets only)")
    p.add_argument("--token-splits", default="", help=f"comma-separated token sets of {', '.join(TOKEN_SPLITS)}")
    p.add_argument("--token-fraction", type=float, default=1 / 3, help="share of the chunk's tokens a token set holds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    mot_cfg = load_translator(args.translator).model.cfg
    config = EvalConfig(dataset=args.dataset, canonical=args.canonical, target=args.target, limit=args.limit,
                        seed=args.seed, store=args.store, modes=["none", "native", "tr", "chunk_native"],
                        variants={"tr": f"{args.translator}@0", "chunk_native": f"{args.translator}@{mot_cfg.tgt_layers}"})
    examples = load_dataset(config.dataset, config.limit, config.seed, config.max_context_chars)
    workdir = Path(args.store).expanduser() if args.store else Path(f"/tmp/cagkv-oracle-{args.seed}")
    store = default_store_factory(config)(workdir / "store")
    runner = ModeRunner(default_engine_factory(config)(store), config)
    splits = hybrid_splits(mot_cfg.groups, mot_cfg.tgt_layers)
    if args.splits == "none":
        splits = {}
    elif args.splits:
        wanted = args.splits.split(",")
        named = {s: splits.get(s) or layer_set_split(s, mot_cfg.tgt_layers) for s in wanted}
        unknown = [s for s, v in named.items() if v is None]
        if unknown:
            raise SystemExit(f"unknown splits {unknown}; known: {sorted(splits)}, or layer sets like l5+11, k5, v5")
        splits = named
    token_splits = [t for t in args.token_splits.split(",") if t]
    if set(token_splits) - set(TOKEN_SPLITS):
        raise SystemExit(f"unknown token splits {sorted(set(token_splits) - set(TOKEN_SPLITS))}; known: {TOKEN_SPLITS}")
    prefix_len = None
    every_layer = list(range(mot_cfg.tgt_layers))
    reported = {**splits, **{t: (every_layer, f"kv at {args.token_fraction:.2f} of the tokens") for t in token_splits}}

    rows: list[dict[str, Any]] = []
    doc_ids: dict[str, str] = {}
    t0 = time.time()
    for n, ex in enumerate(examples, 1):
        if ex.context not in doc_ids:
            doc_ids[ex.context] = ingest_contexts(store, [ex.context], config)[0]
        restrict = [doc_ids[ex.context]]
        prepared = {m: runner.prepare(m, ex.question, restrict)[1] for m in config.modes}
        nat, tr = prepared["chunk_native"], prepared["tr"]
        if nat.next_position != tr.next_position or nat.prompt_ids != tr.prompt_ids:
            raise SystemExit(f"{ex.id}: the two caches differ in shape; cannot mix them")
        row = {"id": ex.id, **{m: answer_logprob(pr, ex.answers[0]) for m, pr in prepared.items()}}
        for name, (layers, part) in splits.items():
            row[name] = answer_logprob(hybrid(tr, nat, layers, part), ex.answers[0])
        if token_splits and prefix_len is None:
            prefix_len = len(tr.fmt.context_prefix_ids())
        for name in token_splits:
            positions = token_positions(name, tr, nat, prefix_len, args.token_fraction)
            row[name] = answer_logprob(token_hybrid(tr, nat, positions), ex.answers[0])
        rows.append(row)
        if n % 25 == 0 or n == len(examples):  # a run cut short keeps what it measured
            summary = write_report(args, mot_cfg.groups, reported, rows, time.time() - t0)
            print(f"{n}/{len(examples)} questions, {time.time() - t0:.0f}s", flush=True)
    print_table(summary)


def write_report(args: argparse.Namespace, groups: list[list[int]], splits: dict[str, tuple[list[int], str]],
                 rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    def triple(iv: Any) -> list[float | None]:
        return [None if not math.isfinite(x) else round(x, 4) for x in (iv.value, iv.lo, iv.hi)]

    def col(name: str) -> list[float | None]:
        return [None if r[name] is None or math.isnan(r[name]) else r[name] for r in rows]

    none, native, tr_col = col("none"), col("native"), col("tr")
    summary: dict[str, Any] = {"tr": triple(recovery(tr_col, none, native)),
                               "chunk_native": triple(recovery(col("chunk_native"), none, native))}
    for name, (layers, part) in splits.items():
        summary[name] = {
            "native_layers": layers, "part": part,
            "recovery": triple(recovery(col(name), none, native)),
            "gain_over_translated": triple(recovery_difference(col(name), tr_col, none, native)),
        }
    report = {"config": {**vars(args), "out": str(args.out), "n": len(rows), "groups": groups,
                         "seconds": round(seconds, 1)},
              "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(f"answer log-prob recovery: translated (replay 0) {100 * summary['tr'][0]:.1f} %, "
          f"every layer recomputed per chunk (replay L) {100 * summary['chunk_native'][0]:.1f} %")
    print("| native part | layers | recovery | gain over translated |\n|---|---|---|---|")
    for name, s in summary.items():
        if name in ("tr", "chunk_native"):
            continue
        r, g, ls = s["recovery"], s["gain_over_translated"], s["native_layers"]
        span = f"{ls[0]}-{ls[-1]}" if ls == list(range(ls[0], ls[-1] + 1)) else "+".join(map(str, ls))
        print(f"| {name} ({s['part']}) | {span} | {100 * r[0]:.1f} % "
              f"[{100 * r[1]:.1f}, {100 * r[2]:.1f}] | {100 * g[0]:+.1f} [{100 * g[1]:+.1f}, {100 * g[2]:+.1f}] |")


if __name__ == "__main__":
    main()
