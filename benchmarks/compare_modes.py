"""Paired comparison of two modes of one `cagkv eval --out` JSON: recovery of A minus B.

Both modes are scored on the same questions, so the difference has a much tighter
interval than the two recoveries' separate intervals suggest. Prints one line per
metric: the difference in recovery points with its paired bootstrap 95 % interval, and one
for the agreement with native's answers (token F1 of the greedy answer against native's,
the report's agreement table; E86: answer log-prob alone rewards a copy bias).
`--rows START:STOP` keeps the questions at those places of the results' order (the seeded
draw's), e.g. `300:600` for the questions a run of 600 added to a run of 300.

Example:
    python benchmarks/compare_modes.py docs/results/squad_replay_smollm2_gemma3.json r4e2e r0
    python benchmarks/compare_modes.py docs/results/squad_e84c_smollm2_qwen25.json e23ak1 e23 --rows 300:600
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cagkv.eval.metrics import bootstrap_mean, recovery_difference, token_f1
from cagkv.eval.report import QUALITY_METRICS


def parse_rows(text: str) -> slice:
    """"START:STOP" (either may be empty) -> the slice of question places it names."""
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return slice(int(start) if start else None, int(stop) if stop else None)
    except ValueError:
        raise SystemExit(f"--rows: expected START:STOP, as in 300:600, got {text!r}") from None


def compare(report: dict, a: str, b: str, n_boot: int = 2000, seed: int = 0,
            rows: slice = slice(None)) -> dict[str, list[float]]:
    """metric -> [difference, lo, hi] of recovery(a) - recovery(b), as fractions, over the
    questions at places `rows` of the results' order."""
    by_key = {(r["id"], r["mode"]): r for r in report["examples"]}
    ids = [i for i in list(dict.fromkeys(r["id"] for r in report["examples"]))[rows]
           if all((i, m) in by_key for m in (a, b, "none", "native"))]
    if not ids:
        raise SystemExit(f"no question has rows for all of {a}, {b}, none and native")
    out = {}
    for metric in QUALITY_METRICS:
        cols = [[by_key[(i, m)].get(metric) for i in ids] for m in (a, b, "none", "native")]
        d = recovery_difference(*cols, n_boot=n_boot, seed=seed)
        out[metric] = [d.value, d.lo, d.hi]
    agree = [token_f1(by_key[(i, a)]["prediction"], [by_key[(i, "native")]["prediction"]])
             - token_f1(by_key[(i, b)]["prediction"], [by_key[(i, "native")]["prediction"]])
             for i in ids if all("prediction" in by_key[(i, m)] for m in (a, b, "native"))]
    if agree:
        d = bootstrap_mean(agree, n_boot=n_boot, seed=seed)
        out["f1_vs_native"] = [d.value, d.lo, d.hi]
    out["n"] = [float(len(ids))] * 3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rows", default=":", help="START:STOP places of the questions to compare (default: all)")
    args = parser.parse_args()
    report = json.loads(args.results.read_text(encoding="utf-8"))
    diff = compare(report, args.a, args.b, rows=parse_rows(args.rows))
    print(f"recovery({args.a}) - recovery({args.b}), paired over n = {int(diff['n'][0])} questions:")
    for metric in QUALITY_METRICS:
        value, lo, hi = diff[metric]
        print(f"  {metric:15} {100 * value:+6.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]")
    if "f1_vs_native" in diff:
        value, lo, hi = diff["f1_vs_native"]
        print(f"  {'f1_vs_native':15} {value:+.3f} [{lo:+.3f}, {hi:+.3f}] (token F1 against native's answer, A - B)")


if __name__ == "__main__":
    main()
