"""Context-aware decoding over a translated cache: amplify what the document changes (a probe).

For each question (one chunk, oracle retrieval, the real ingest / assemble path) the target
answers from the translated cache (r = 0) and from native prefill, each decoded greedily
from `(1 + a) log p(y | document, question) - a log p(y | question)` (Shi et al. 2023,
"Trusting Your Evidence"): the question without the document (`none`) runs beside it, token
for token. a = 0 is the plain answer (the probe checks it against the engine's own
`generate`). Per a: token F1 against the gold answer and against native's plain answer, and
the gold answer's mean log-prob under the combined distribution; recoveries and paired
differences against a = 0 as `cagkv eval` computes them (docs/EXPERIMENTS.md E96).
`--summarize FILE...` recomputes the summary over the rows of several runs (the halves below);
`--reuse RESULTS.json` takes the a = 0 answers and log-probs from a `cagkv eval` run over the same
questions (its none / native / r = 0 rows), so only a > 0 is decoded.

Example (E96, the first 60 questions of the SQuAD draw, in two halves at once):
    CAGKV_LINEAR_DTYPE=float32 python benchmarks/context_contrast_probe.py --target qwen2.5-0.5b \\
        --stop 30 --alphas 0.5,1 --out /tmp/cad_1.json   # and --start 30 --stop 60 --out /tmp/cad_2.json
    python benchmarks/context_contrast_probe.py --target qwen2.5-0.5b --summarize /tmp/cad_1.json /tmp/cad_2.json --out /tmp/cad.json
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cagkv.eval.datasets import load_dataset
from cagkv.eval.metrics import answer_span, recovery, recovery_difference, token_f1
from cagkv.eval.runner import EvalConfig, answer_ids, default_store_factory, ingest_contexts
from cagkv.pipeline import CAG, Prepared, greedy_decode
from cagkv.refresh import feed


@torch.inference_mode()
def contrast_logprobs(ctx: Prepared, plain: Prepared, ids: list[int], alpha: float) -> torch.Tensor:
    """Log-probs `[len(ids), V]` of the combined distribution over `ids` fed after each prompt."""
    def logp(p: Prepared) -> torch.Tensor:
        _, logits = feed(p.target.model, copy.deepcopy(p.cache), p.next_position, list(p.prompt_ids) + ids,
                         p.stale, keep=0, bias=p.bias)
        return torch.log_softmax(logits[len(p.prompt_ids) - 1:].float(), dim=-1)
    return torch.log_softmax((1 + alpha) * logp(ctx) - alpha * logp(plain), dim=-1)


def gold_logprob(ctx: Prepared, plain: Prepared, answer: str, alpha: float) -> float:
    gold = answer_ids(ctx.target.tokenizer, list(ctx.prompt_ids), answer)
    if not gold or gold != answer_ids(plain.target.tokenizer, list(plain.prompt_ids), answer):
        return float("nan")
    logp = contrast_logprobs(ctx, plain, gold[:-1], alpha)  # row i predicts gold[i]
    return float(logp.gather(1, torch.tensor(gold)[:, None]).mean())


@torch.inference_mode()
def contrast_answer(ctx: Prepared, plain: Prepared, alpha: float, max_new_tokens: int) -> str:
    """Greedy answer under the combined distribution, decoded by the engine's own `greedy_decode`."""
    model = ctx.target.model
    states = []
    for p in (ctx, plain):
        cache, logits = feed(model, copy.deepcopy(p.cache), p.next_position, list(p.prompt_ids), p.stale, bias=p.bias)
        states.append([cache, p.next_position + len(p.prompt_ids), logits[-1].float(), p.bias])

    def mixed() -> torch.Tensor:
        return (1 + alpha) * torch.log_softmax(states[0][2], -1) - alpha * torch.log_softmax(states[1][2], -1)

    def step(token: int) -> torch.Tensor:
        for state in states:
            cache, position, _, bias = state
            _, logits = feed(model, cache, position, [token], None, bias=bias)
            state[0], state[1], state[2] = cache, position + 1, logits[-1].float()
        return mixed()

    text = ""
    for _, _, text in greedy_decode(ctx.target.tokenizer, ctx.fmt, mixed(), step, max_new_tokens):
        pass
    return answer_span(text.strip())


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Recoveries, agreement with native's plain answer and paired differences against a = 0, printed and returned."""
    labels = {k for r in rows for k in r if "@" in k and not k.endswith(":logprob")}
    keys = sorted(labels, key=lambda k: (not k.startswith("native"), float(k.split("@")[1])))
    f1 = token_f1  # the best over the gold answers, as cagkv eval scores
    none_f1 = [f1(r["none"], r["gold"]) for r in rows]
    native_f1 = [f1(r["native@0"], r["gold"]) for r in rows]
    none_lp = [r["none:logprob"] for r in rows]
    native_lp = [r["native@0:logprob"] for r in rows]
    checked = [r for r in rows if "engine_translated" in r]  # not where a = 0 came from an eval run
    summary: dict[str, Any] = {"engine_agrees": sum(r["engine_translated"] == r["translated@0"] for r in checked),
                               "engine_checked": len(checked)}
    print(f"n = {len(rows)}; a = 0 equals the engine's answer on {summary['engine_agrees']} of {len(checked)} checked")
    for key in keys:
        col_f1 = [f1(r[key], r["gold"]) for r in rows]
        col_lp = [r[key + ":logprob"] for r in rows]
        base = "native@0" if key.startswith("native") else "translated@0"
        rec_f1, rec_lp = recovery(col_f1, none_f1, native_f1), recovery(col_lp, none_lp, native_lp)
        d_f1 = recovery_difference(col_f1, [f1(r[base], r["gold"]) for r in rows], none_f1, native_f1)
        d_lp = recovery_difference(col_lp, [r[base + ":logprob"] for r in rows], none_lp, native_lp)
        agree = sum(token_f1(r[key], [r["native@0"]]) for r in rows) / len(rows)
        summary[key] = {"f1_recovery": rec_f1.value, "logprob_recovery": rec_lp.value, "agreement": agree,
                        "f1_vs_base": [d_f1.value, d_f1.lo, d_f1.hi], "logprob_vs_base": [d_lp.value, d_lp.lo, d_lp.hi]}
        print(f"  {key:16s} F1 rec {100 * rec_f1.value:6.1f} %  log-prob rec {100 * rec_lp.value:6.1f} %  "
              f"agreement {agree:.3f}  vs {base}: F1 {100 * d_f1.value:+.1f} [{100 * d_f1.lo:+.1f}, {100 * d_f1.hi:+.1f}]"
              f"  log-prob {100 * d_lp.value:+.1f} [{100 * d_lp.lo:+.1f}, {100 * d_lp.hi:+.1f}]")
    for key in keys:  # like for like: the translation at a against native at the same a
        a = key.split("@")[1]
        if key.startswith("translated") and a != "0" and f"native@{a}" in labels:
            t_a, n_a, t_0, n_0 = ([f1(r[k], r["gold"]) for r in rows]
                                  for k in (key, f"native@{a}", "translated@0", "native@0"))
            diff = recovery_difference(t_a, t_0, none_f1, n_a, native_b=n_0)
            summary[f"like_for_like@{a}"] = [diff.value, diff.lo, diff.hi]
            print(f"  F1 recovery of the translation against native both at a = {a}, minus the same at a = 0: "
                  f"{100 * diff.value:+.1f} [{100 * diff.lo:+.1f}, {100 * diff.hi:+.1f}]")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--canonical", default="smollm2-135m")
    ap.add_argument("--dataset", default="../shared/data/squad_v1.1_dev_even_articles.jsonl")
    ap.add_argument("--start", type=int, default=0, help="first question of the seeded draw")
    ap.add_argument("--stop", type=int, default=60)
    ap.add_argument("--alphas", default="0.25,0.5,1", help="comma-separated amplifications besides 0")
    ap.add_argument("--native-alphas", default="0.5", help="the same for native prefill (a control)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", required=True, help="per-question rows and the summary as JSON")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--summarize", nargs="*", default=None, help="summarize the rows of these --out files (no run)")
    ap.add_argument("--reuse", default="", help="a `cagkv eval` results JSON over the same questions: its rows give "
                    "the a = 0 answers and log-probs (none, native, translated), so only a > 0 is decoded here")
    ap.add_argument("--no-engine-check", action="store_true", help="skip checking a = 0 against the engine's generate")
    ap.add_argument("--reuse-labels", default="none,native,e23", help="its mode labels for none, native and r = 0")
    args = ap.parse_args()
    if args.summarize is not None:
        rows = [r for f in args.summarize for r in json.loads(Path(f).read_text())["rows"]]
        Path(args.out).write_text(json.dumps({"files": args.summarize, "summary": summarize(rows)}, indent=1) + "\n")
        return
    torch.set_num_threads(args.threads)
    alphas = [float(a) for a in args.alphas.split(",") if a.strip()]
    native_alphas = [float(a) for a in args.native_alphas.split(",") if a.strip()]

    config = EvalConfig(dataset=args.dataset, canonical=args.canonical, target=args.target)
    examples = load_dataset(args.dataset, limit=args.stop, seed=0)[args.start : args.stop]
    reused: dict[tuple[str, str], dict[str, Any]] = {}
    if args.reuse:
        labels = dict(zip(("none", "native@0", "translated@0"), args.reuse_labels.split(",")))
        wanted = {v: k for k, v in labels.items()}
        reused = {(r["id"], wanted[r["mode"]]): r for r in json.loads(Path(args.reuse).read_text())["examples"]
                  if r.get("mode") in wanted}
        native_alphas = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = default_store_factory(config)(Path(tmp) / "store")
        engine = CAG(store, canonical=args.canonical)
        documents = ingest_contexts(store, [e.context for e in examples], config, progress=not args.no_progress)
        for example, document in tqdm(list(zip(examples, documents)), desc="questions", disable=args.no_progress):
            ask = dict(target=args.target, document_ids=[document], top_k=1)
            plain = engine.prepare(example.question, mode="none", **ask)
            translated = engine.prepare(example.question, mode="translate", replay=0, refresh=0.0, **ask)
            gold = example.answers
            row: dict[str, Any] = {"id": example.id, "gold": gold}
            if reused:
                for key in ("none", "native@0", "translated@0"):
                    got = reused[(example.id, key)]
                    row[key], row[key + ":logprob"] = got["prediction"], got["answer_logprob"]
                grids = [("translated", translated, alphas)]
            else:
                native = engine.prepare(example.question, mode="native", **ask)
                row["none"] = contrast_answer(plain, plain, 0.0, args.max_new_tokens)
                row["none:logprob"] = gold_logprob(plain, plain, gold[0], 0.0)
                if not args.no_engine_check:
                    row["engine_translated"] = answer_span(engine.generate(
                        engine.prepare(example.question, mode="translate", replay=0, refresh=0.0, **ask),
                        max_new_tokens=args.max_new_tokens).text)
                grids = [("native", native, [0.0, *native_alphas]), ("translated", translated, [0.0, *alphas])]
            for name, prepared, grid in grids:
                for a in grid:
                    key = f"{name}@{a:g}"
                    row[key] = contrast_answer(prepared, plain, a, args.max_new_tokens)
                    row[key + ":logprob"] = gold_logprob(prepared, plain, gold[0], a)
            rows.append(row)

    summary = summarize(rows)
    Path(args.out).write_text(json.dumps({"target": args.target, "canonical": args.canonical,
                                          "questions": [args.start, args.start + len(rows)],
                                          "summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
