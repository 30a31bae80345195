"""Needle-in-a-haystack results by context length and needle depth, per mode.

Reads a `cagkv eval --out` JSON run on the needle set and the dataset file itself (for
each example's `meta.context_chars_budget` and `meta.depth_percent`), prints a markdown
table (mean token F1 per length, per mode) and writes one heatmap per mode (rows:
context length in characters, columns: needle depth in %, cell: token F1 against the
needle). Needs the `plots` extra (matplotlib) for the PNG.

Example:
    python benchmarks/plot_needle.py docs/results/needle_smollm2_gemma3.json \
        --dataset ../shared/data/niah_paulgraham.jsonl --out docs/results/needle_smollm2_gemma3.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def needle_grid(report: dict, meta: dict[str, dict], metric: str = "f1") -> dict[str, dict[tuple[int, int], float]]:
    """mode -> {(context chars, depth %): metric} from the report's per-example rows."""
    grid: dict[str, dict[tuple[int, int], float]] = defaultdict(dict)
    for row in report["examples"]:
        m = meta.get(row["id"])
        if m is None or row.get(metric) is None:
            continue
        grid[row["mode"]][(int(m["context_chars_budget"]), int(m["depth_percent"]))] = float(row[metric])
    return dict(grid)


def length_table(grid: dict[str, dict[tuple[int, int], float]], modes: list[str]) -> str:
    """Markdown: mean metric (%) per context length (rows) and mode (columns)."""
    lengths = sorted({length for cells in grid.values() for length, _ in cells})
    lines = ["| context chars | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for length in lengths:
        cells = []
        for mode in modes:
            vals = [v for (n, _), v in grid.get(mode, {}).items() if n == length]
            cells.append(f"{100 * sum(vals) / len(vals):.0f} (n={len(vals)})" if vals else "-")
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--dataset", type=Path, required=True, help="the needle JSONL the eval ran on")
    parser.add_argument("--metric", default="f1", choices=["f1", "em"])
    parser.add_argument("--out", type=Path, help="PNG with one heatmap per mode")
    args = parser.parse_args()
    report = json.loads(args.results.read_text(encoding="utf-8"))
    meta = {}
    for line in args.dataset.read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            meta[str(obj["id"])] = obj.get("meta") or {}
    grid = needle_grid(report, meta, args.metric)
    modes = [m for m in report["modes"] if m in grid]
    print(length_table(grid, modes))
    if not args.out:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({n for cells in grid.values() for n, _ in cells})
    depths = sorted({d for cells in grid.values() for _, d in cells})
    fig, axes = plt.subplots(1, len(modes), figsize=(2.6 * len(modes) + 1, 3.2), dpi=100, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        data = [[100 * grid[mode].get((n, d), float("nan")) for d in depths] for n in lengths]
        im = ax.imshow(data, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_title(mode, fontsize=9)
        ax.set_xticks(range(len(depths)), [str(d) for d in depths], fontsize=6)
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_xlabel("needle depth %", fontsize=7)
    axes[0][0].set_ylabel("context characters", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label=f"{args.metric} %")
    title = f"Needle in a haystack: {report['canonical']} -> {report['target']} (n={report['n']})"
    fig.suptitle(title, fontsize=9, y=1.04)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
