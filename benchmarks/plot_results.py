"""Plot recovery against time to first token per mode, from `cagkv eval --out` JSON files.

Each mode is one point: x = mean TTFT (ms), y = recovery of the answer log-prob (%), with
the paired bootstrap 95 % interval as an error bar; `none` sits at 0 % and `native` at
100 % by definition. Needs the `plots` extra (matplotlib).

With `--ttft BENCH.json --length N` the x axis is the side-by-side median TTFT that
`benchmarks/ttft.py` measured for the mode of the same name at N context tokens (modes
measured alternately in one run, so their ratios are comparable), not the eval's mean.

Example:
    python benchmarks/plot_results.py docs/results/squad_*.json --out docs/results/recovery_vs_ttft.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(report: dict, metric: str, ttft: dict[str, float] | None = None) -> list[tuple[str, float, float, float, float]]:
    """(mode, ttft_ms, recovery %, lo %, hi %) per mode; x from `ttft` by mode name when given."""
    out = []
    for mode, m in report["modes"].items():
        if ttft is not None and mode not in ttft:
            continue
        if mode == "none":
            y = lo = hi = 0.0
        elif mode == "native":
            y = lo = hi = 100.0
        else:
            r = report["recovery"].get(mode, {})
            if r.get(metric) is None:
                continue
            ci = r.get(f"{metric}_ci") or [None, None]
            y = 100 * r[metric]
            lo = 100 * ci[0] if ci[0] is not None else y
            hi = 100 * ci[1] if ci[1] is not None else y
        out.append((mode, m["ttft_ms"] if ttft is None else ttft[mode], y, lo, hi))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--metric", default="answer_logprob", choices=["answer_logprob", "f1", "em"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ttft", type=Path, help="benchmarks/ttft.py JSON: x = its median TTFT per mode")
    parser.add_argument("--length", type=int, help="context tokens of the --ttft rows to use")
    parser.add_argument("--same-time", action="append", default=[], metavar="MODE=BENCH_MODE",
                        help="take MODE's x from the --ttft row of BENCH_MODE (e.g. r4e2e=r4: the same "
                             "computation with other head weights); repeatable")
    args = parser.parse_args()
    ttft = None
    if args.ttft:
        bench = json.loads(args.ttft.read_text(encoding="utf-8"))
        ttft = {r["mode"]: r["ttft"] for r in bench["rows"] if args.length is None or r["length"] == args.length}
        for pair in args.same_time:
            mode, _, bench_mode = pair.partition("=")
            if bench_mode not in ttft:
                parser.error(f"--same-time {pair}: no --ttft row for mode {bench_mode!r}")
            ttft[mode] = ttft[bench_mode]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for path in args.results:
        report = json.loads(path.read_text(encoding="utf-8"))
        pair = f"{report['canonical']} -> {report['target']} (n={report['n']})"
        pts = points(report, args.metric, ttft)
        xs = [p[1] for p in pts]
        ys = [p[2] for p in pts]
        err = [[p[2] - p[3] for p in pts], [p[4] - p[2] for p in pts]]
        line = ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=pair)
        for mode, x, y, _, _ in pts:
            ax.annotate(mode, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8,
                        color=line[0].get_color())
    ax.axhline(0, color="grey", lw=0.5)
    ax.axhline(100, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("time to first token, ms (2-core CPU, 1 thread; " +
                  (f"side-by-side median, {args.length} tokens)" if ttft is not None else "eval mean)"))
    ax.set_ylabel(f"recovery of {args.metric} (%)")
    ax.set_title("Recovery vs time to first token per mode (SQuAD, oracle retrieval)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
