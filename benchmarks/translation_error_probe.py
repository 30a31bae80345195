"""Where a translated cache is wrong: K/V error of the tokens refresh leaves translated, and where the question looks.

For each question (one chunk, oracle retrieval, the real ingest / assemble path), three
caches of the same positions: native prefill, the translation (r = 0) and the translation
with `--fraction` of the chunk refreshed (`--scoring`). Per layer, the squared error of the
tokens left translated against native's, over native's variance across the chunk (keys
before RoPE), as translated and with each correction of docs/EXPERIMENTS.md E84:
  chunk shift   each chunk moved by its refreshed tokens' mean change (`refresh_shift`)
  global shift  one offset, native - translated averaged over the *earlier* questions
  kv_bias       the offsets in `--kv-bias FILE` (benchmarks/fit_kv_bias.py)
  chunk oracle  each chunk moved by its own mean error (needs native: a bound, not a method)
Then the question's attention over the cached tokens (summed over layers, heads and its
tokens): the share on the context prefix (its first token apart) and on the chunk, for
native prefill, the translation and each `--compare` translator folder.

Example (E84's tables, 40 and 20 questions drawn after the first 600):
    python benchmarks/translation_error_probe.py --target gemma3-270m --start 600 --stop 640 \\
        --kv-bias ~/.cache/cagkv/runs/e84/gemma_pubmed/kv_bias.safetensors --compare ~/.cache/cagkv/runs/e84/gemma_pubmed
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from cagkv.eval.datasets import load_dataset
from cagkv.eval.runner import EvalConfig, default_store_factory, ingest_contexts
from cagkv.pipeline import CAG
from cagkv.refresh import prompt_attention
from cagkv.translate import find_translator, load_translator
from cagkv.translate.kv_bias import chunk_kv


def errors(native: torch.Tensor, translated: torch.Tensor, refreshed: torch.Tensor, chosen: torch.Tensor,
           earlier: torch.Tensor | None, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per-layer error `[L]` of the tokens not `chosen`, for each correction; tensors `[L, H, T, D]`."""
    rest = ~chosen
    want, have = native[:, :, rest], translated[:, :, rest]
    spread = ((want - want.mean(dim=2, keepdim=True)) ** 2).sum(-1).mean(dim=(1, 2))

    def err(x: torch.Tensor) -> torch.Tensor:
        return ((x - want) ** 2).sum(-1).mean(dim=(1, 2)) / spread

    out = {"as translated": err(have),
           "chunk shift": err(have + (refreshed[:, :, chosen] - translated[:, :, chosen]).mean(dim=2, keepdim=True)),
           "chunk oracle": err(have + (want - have).mean(dim=2, keepdim=True))}
    if earlier is not None:
        out["global shift"] = err(have + earlier[:, :, None])
    if bias is not None:
        out["kv_bias"] = err(have + bias[:, :, None])
    return out


def attention_share(prepared, chunk_stop: int) -> tuple[float, float, float]:
    """(prefix, first token, chunk) shares of the question's attention over the cached tokens."""
    mass = prompt_attention(prepared.target.model, prepared.cache, prepared.next_position, [prepared.prompt_ids])[0]
    first = len(prepared.fmt.context_prefix_ids())
    total = float(mass.sum())
    return float(mass[:first].sum()) / total, float(mass[0]) / total, float(mass[first:chunk_stop].sum()) / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--canonical", default="smollm2-135m")
    ap.add_argument("--translator", default="", help="translator folder (default: the installed one)")
    ap.add_argument("--dataset", default="../shared/data/squad_v1.1_dev_even_articles.jsonl")
    ap.add_argument("--start", type=int, default=600, help="first question of the seeded draw")
    ap.add_argument("--stop", type=int, default=640)
    ap.add_argument("--fraction", type=float, default=1 / 3)
    ap.add_argument("--scoring", default="adaptive")
    ap.add_argument("--kv-bias", default="", help="a kv_bias.safetensors to score as a correction")
    ap.add_argument("--compare", action="append", default=[], help="translator folders for the attention shares")
    ap.add_argument("--out", default="", help="write the per-layer means as JSON here")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from safetensors.torch import load_file

    config = EvalConfig(dataset=args.dataset, canonical=args.canonical, target=args.target)
    examples = load_dataset(args.dataset, limit=args.stop, seed=0)[args.start : args.stop]
    bias = load_file(str(Path(args.kv_bias).expanduser())) if args.kv_bias else {}
    with tempfile.TemporaryDirectory() as tmp:
        store = default_store_factory(config)(Path(tmp) / "store")
        engines: dict[str, CAG] = {}
        for name, folder in (("translated", args.translator), *((Path(c).name, c) for c in args.compare)):
            translator = load_translator(Path(folder).expanduser()) if folder else None
            engines[name] = CAG(store, canonical=args.canonical,
                                find_translator=(lambda s, t, tr=translator: tr) if folder else find_translator)
            engines[name].fuse_feed = False  # refresh recomputes before the question: its cache is complete
        documents = ingest_contexts(store, [e.context for e in examples], config, progress=True)
        engine = engines["translated"]
        per_layer: dict[str, list[torch.Tensor]] = defaultdict(list)
        shares: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        offsets: dict[str, list[torch.Tensor]] = defaultdict(list)
        for example, document in tqdm(list(zip(examples, documents)), desc="questions"):
            ask = dict(target=args.target, document_ids=[document], top_k=1)
            native = engine.prepare(example.question, mode="native", **ask)
            translated = engine.prepare(example.question, mode="translate", refresh=0.0, **ask)
            refreshed = engine.prepare(example.question, mode="translate", refresh=args.fraction,
                                       refresh_scoring=args.scoring, **ask)
            first, stop = len(native.fmt.context_prefix_ids()), translated.next_position
            kv = {name: chunk_kv(p, first, stop) for name, p in
                  (("native", native), ("translated", translated), ("refreshed", refreshed))}
            chosen = (kv["refreshed"][1] != kv["translated"][1]).any(dim=-1).any(dim=(0, 1))  # [T]
            for i, part in enumerate(("keys", "values")):
                nat, tra, ref = kv["native"][i], kv["translated"][i], kv["refreshed"][i]
                earlier = torch.stack(offsets[part]).mean(dim=0) if offsets[part] else None
                for name, value in errors(nat, tra, ref, chosen, earlier, bias.get(part)).items():
                    per_layer[f"{part} {name}"].append(value)
                offsets[part].append((nat[:, :, ~chosen] - tra[:, :, ~chosen]).mean(dim=2))
            shares["native"].append(attention_share(native, stop))
            shares["translated"].append(attention_share(translated, stop))  # the pass reads a copy of the cache
            for name, other in engines.items():
                if name != "translated":
                    shares[name].append(attention_share(
                        other.prepare(example.question, mode="translate", refresh=0.0, **ask), stop))
    result = {"errors": {k: torch.stack(v).mean(dim=0).tolist() for k, v in per_layer.items()},
              "attention_share": {k: dict(zip(("prefix", "first_token", "chunk"), torch.tensor(v).mean(dim=0).tolist()))
                                  for k, v in shares.items()},
              "questions": len(examples), "target": args.target, "fraction": args.fraction, "scoring": args.scoring}
    print("error of the tokens left translated (squared error / native's variance over the chunk; mean of layers):")
    for key, values in result["errors"].items():
        print(f"  {key:28s} {sum(values) / len(values):.3f} | " + " ".join(f"{x:.2f}" for x in values))
    print("share of the question's attention over the cached tokens:")
    for key, s in result["attention_share"].items():
        print(f"  {key:28s} prefix {s['prefix']:.3f} (first token {s['first_token']:.3f}), chunk {s['chunk']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
