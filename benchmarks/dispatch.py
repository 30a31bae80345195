"""Sparse expert dispatch against dense evaluation of every expert, on large token batches.

For E experts and top-k routing, dense evaluation costs E/k times the sparse FLOPs; the
goal (DESIGN.md §7) is a measured speed-up of at least 0.7-0.8 x E/k. Shapes are those of
the shipped translator's expert layer (d=192, hidden=384). Implementations are timed
interleaved (median of repeats) so machine load hits them alike.

Example:
    python benchmarks/dispatch.py --tokens 16384 --repeats 5 --threads 1 \
        --out docs/benchmarks/dispatch.json --markdown docs/benchmarks/dispatch.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from cagkv.translate.dispatch import dispatch_experts


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def run(tokens: int, d: int, h: int, grid: list[tuple[int, int]], impls: list[str], repeats: int, device: str,
        dtype: torch.dtype) -> list[dict]:
    rows = []
    for n_exp, k in grid:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d, generator=g).to(device, dtype)
        W1 = (torch.randn(n_exp, d, h, generator=g) / d**0.5).to(device, dtype)
        b1 = torch.zeros(n_exp, h, device=device, dtype=dtype)
        W2 = (torch.randn(n_exp, h, d, generator=g) / h**0.5).to(device, dtype)
        b2 = torch.zeros(n_exp, d, device=device, dtype=dtype)
        top = torch.randn(tokens, n_exp, generator=g).topk(k, dim=1)
        idx, gate = top.indices.to(device), torch.softmax(top.values, 1).to(device, dtype)
        fns = {impl: (lambda impl=impl: dispatch_experts(x, idx, gate, W1, b1, W2, b2, impl=impl)) for impl in impls}
        with torch.no_grad():
            ref = fns["dense"]()
            for impl in impls:  # warm-up + agreement check
                err = float((fns[impl]() - ref).abs().max())
                tol = 1e-2 if dtype == torch.float32 else 5e-2  # bfloat16: a few of its 8-bit ulps
                assert err < tol * max(1.0, float(ref.abs().max())), (impl, err)
            times: dict[str, list[float]] = {impl: [] for impl in impls}
            for _ in range(repeats):
                for impl in impls:
                    times[impl] += _time(fns[impl], 1)
        med = {impl: statistics.median(ts) for impl, ts in times.items()}
        for impl in impls:
            rows.append({
                "experts": n_exp, "top_k": k, "impl": impl, "tokens": tokens, "ms": round(med[impl] * 1e3, 2),
                "tokens_per_s": round(tokens / med[impl]),
                "speedup_vs_dense": round(med["dense"] / med[impl], 2), "ideal_E_over_k": n_exp / k,
                "fraction_of_ideal": round(med["dense"] / med[impl] / (n_exp / k), 2),
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--grid", default="4:1,4:2,8:1,8:2", help="E:k pairs")
    ap.add_argument("--impls", default="dense,loop,bmm,grouped")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    grid = [tuple(int(v) for v in p.split(":")) for p in a.grid.split(",")]
    rows = run(a.tokens, a.d, a.hidden, grid, a.impls.split(","), a.repeats, a.device, dtype)
    meta = {"device": a.device, "dtype": str(dtype), "threads": a.threads, "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "d": a.d, "hidden": a.hidden,
            "command": "python benchmarks/dispatch.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k not in ("out", "markdown"))}
    lines = [f"| E | k | impl | ms ({a.tokens} tokens) | tokens/s | speed-up vs dense | / (E/k) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['experts']} | {r['top_k']} | {r['impl']} | {r['ms']} | {r['tokens_per_s']} | "
                     f"{r['speedup_vs_dense']} | {r['fraction_of_ideal']} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        a.markdown.write_text(f"# Expert dispatch: sparse vs dense\n\n`{meta['command']}`\n\n"
                              f"{meta['device']}, {meta['dtype']}, {a.threads} thread(s), torch {meta['torch']}; "
                              f"d={a.d}, hidden={a.hidden}; median of {a.repeats} interleaved repeats.\n\n{table}\n")


if __name__ == "__main__":
    main()
