"""Time to first token: translated (or canonical) cache against native prefill, side by side.

For each context length, real text of about that many canonical tokens is ingested as one
document (chunked as usual); one question is then answered with every chunk of it
retrieved, in each mode, `--repeats` times after one warm-up, alternating modes so that
machine load hits them alike. Reports the median split (retrieve, load, translate, replay,
prefill, first token) and the native / mode ratio.

Example:
    python benchmarks/ttft.py --canonical smollm2-135m --target gemma3-270m \
        --modes native,translate --lengths 512,2048 --repeats 3 \
        --out docs/results/ttft_smollm2_gemma3.json --markdown docs/results/ttft_smollm2_gemma3.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cagkv.errors import UsageError
from cagkv.eval.runner import TTFT_KEYS, Variant, git_commit, machine_description, variant_spec

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "examples" / "docs"
QUESTION = "What is the main point the author makes?"


def read_text(paths: list[Path]) -> str:
    """All .txt/.md files under the given paths, joined by blank lines."""
    parts = []
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md")) if path.is_dir() else [path]
        parts += [f.read_text(encoding="utf-8") for f in files]
    text = "\n\n".join(p.strip() for p in parts if p.strip())
    if not text:
        raise SystemExit(f"no text found in {paths}")
    return text


def context_of(text: str, tokenizer, n_tokens: int) -> str:
    """The first `n_tokens` canonical tokens of the text (repeated if it is shorter)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:n_tokens])


ENGINE_MODES = ("none", "native", "canonical", "translate", "mot-window", "auto")


def parse_mode(spec: str) -> tuple[str, str, Variant, str | None]:
    """`[LABEL=]MODE[@R|@refreshF][+biasB[+SCOPE flags]]` (an engine mode, replay R or refresh F for translate:
    `r2=translate@2`) or `LABEL=DIR[@R|@window|@refreshF][+biasB]` (translate with the artifact in
    DIR, as in `cagkv eval`) -> (label, engine mode, variant, translator dir or None)."""
    label, _, body = spec.partition("=")
    body = body or label
    try:  # the `cagkv eval` syntax and its checks, for engine modes and folders alike
        variant = variant_spec(body)
    except UsageError as e:
        raise SystemExit(f"{e} in {spec!r} (a translator folder goes before '@': LABEL=DIR@R)") from None
    path = variant.path
    if path in ENGINE_MODES:
        return label, "mot-window" if variant.window else path, variant, None
    if not Path(path).is_dir():
        raise SystemExit(f"--modes: {path!r} is neither a mode ({', '.join(ENGINE_MODES)}) nor a translator folder")
    return label, "mot-window" if variant.window else "translate", variant, path


LINEAR_PATHS = ("float32", "bfloat16", "float32-unfolded", "bfloat16-unfolded")


def expand_linear_dtypes(modes: list[str], dtypes: str | None) -> tuple[dict[str, tuple], dict[str, tuple | None]]:
    """Mode specs by row label, and each row's translator linear path as (dtype, folded)
    (None: the machine's dtype, folded). With `dtypes` ("float32,bfloat16-unfolded") every
    translating mode becomes one row per entry, labelled LABEL:ENTRY; other modes keep one
    row. `-unfolded` runs the training graph with a folded linear path (E55) instead of the
    folded inference form (E56)."""
    names = [d.strip() for d in (dtypes or "").split(",") if d.strip()]
    for name in names:
        if name not in LINEAR_PATHS:
            raise SystemExit(f"--linear-dtypes: {name!r} is not one of {', '.join(LINEAR_PATHS)}")
    specs: dict[str, tuple] = {}
    linear: dict[str, tuple | None] = {}
    for m in modes:
        spec = parse_mode(m)
        label = spec[0]
        if spec[1] in ("translate", "mot-window", "auto") and names:
            for name in names:
                dtype, _, unfolded = name.partition("-")
                specs[f"{label}:{name}"] = (f"{label}:{name}", *spec[1:])
                linear[f"{label}:{name}"] = (getattr(torch, dtype), not unfolded)
        else:
            specs[label], linear[label] = spec, None
    return specs, linear


def measure(engine, target: str, mode: str, variant: Variant, document_id: str, top_k: int) -> dict[str, float]:
    """One answer's first-token timings for an engine mode (replay None: the translator's default)."""
    replay = variant.replay if variant.replay is not None else (0 if mode == "translate" else None)
    prepared = engine.prepare(QUESTION, target=target, mode=mode, top_k=top_k, document_ids=[document_id],
                              replay=replay, refresh=variant.refresh,
                              refresh_scoring=variant.refresh_scoring, attention_bias=variant.attention_bias,
                              attention_bias_scope=variant.bias_scope)
    answer = engine.generate(prepared, max_new_tokens=1)
    split = {k: float(answer.timings_ms.get(k) or 0.0) for k in TTFT_KEYS}
    split["ttft"] = split["first_token"]  # the engine measures first_token from the question on
    split["context_tokens"] = float(prepared.next_position)
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canonical", default="smollm2-135m")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--modes", default="native,translate",
                        help="engine modes, comma-separated; translate@R replays the top R target layers, "
                             "translate@refreshF[:contrast] recomputes the question's share F of the chunk tokens; "
                             "LABEL=MODE names the row (r2=translate@2); LABEL=DIR[@R|@window|@refreshF] translates "
                             "with the artifact in DIR (several artifacts side by side)")
    parser.add_argument("--translator", default=None,
                        help="translator artifact folder for plain translate modes (default: the installed one)")
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--text", type=Path, nargs="*", default=[DEFAULT_TEXT])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help="dtype the target answers in")
    parser.add_argument("--linear-dtypes", default=None,
                        help="translators' linear paths, comma-separated, of float32, bfloat16, "
                             "float32-unfolded, bfloat16-unfolded: each translating mode gets one row per "
                             "entry, LABEL:ENTRY, side by side (default: the machine's dtype, CAGKV_LINEAR_DTYPE, "
                             "folded)")
    parser.add_argument("--unfused", action="store_true",
                        help="also run each translating mode with the chunk separators and refreshed tokens "
                             "in forwards of their own (CAG.fuse_feed False, as before E62): rows LABEL:unfused")
    parser.add_argument("--embedder", default=None, help="store embedder (default minilm-l6)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from cagkv.ingest import ingest_text
    from cagkv.models import load
    from cagkv.pipeline import CAG
    from cagkv.stores import CacheStore

    specs, linear = expand_linear_dtypes([m.strip() for m in args.modes.split(",") if m.strip()], args.linear_dtypes)
    fused = dict.fromkeys(specs, True)
    if args.unfused:
        for m, spec in list(specs.items()):
            if spec[1] in ("translate", "mot-window", "auto"):
                specs[f"{m}:unfused"], linear[f"{m}:unfused"], fused[f"{m}:unfused"] = spec, linear[m], False
    modes = list(specs)  # checked before any model loads
    lengths = [int(x) for x in args.lengths.split(",")]
    canonical = load(args.canonical, dtype=torch.float32)
    text = read_text(args.text)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cagkv-ttft-") as tmp:
        store = CacheStore.open(Path(tmp) / "store", canonical=args.canonical,
                                fingerprint=canonical.fingerprint, embedder=args.embedder)
        contexts = [context_of(text, canonical.tokenizer, n) for n in lengths]
        doc_ids = [str(ingest_text(store, c, f"ttft:{n}", loaded=canonical,
                                   chunk_tokens=args.chunk_tokens).document_id)
                   for c, n in zip(contexts, lengths)]
        from cagkv.translate import find_translator, load_translator

        def engine_for(path: str | None, linear_path: tuple | None, fuse: bool) -> CAG:
            path = path or args.translator

            def finder(src: str, tgt: str):
                tr = load_translator(path, src, tgt) if path else find_translator(src, tgt)
                if tr is not None and linear_path is not None:
                    tr.set_linear_path(*linear_path)
                return tr

            engine = CAG(store, canonical=args.canonical, dtype=args.dtype, find_translator=finder)
            engine.fuse_feed = fuse
            return engine

        engines = {key: engine_for(*key) for key in {(spec[3], linear[m], fused[m]) for m, spec in specs.items()}}

        def run(m: str, doc: str, top_k: int) -> dict[str, float]:
            _, mode, variant, path = specs[m]
            return measure(engines[path, linear[m], fused[m]], args.target, mode, variant, doc, top_k)

        for n, doc in zip(lengths, doc_ids):
            top_k = -(-n // args.chunk_tokens) + 1  # every chunk of the document
            samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for m in modes:  # warm-up: loads models and translators, first-call overheads
                run(m, doc, top_k)
            for _ in range(args.repeats):
                for m in modes:
                    samples[m].append(run(m, doc, top_k))
            for m in modes:
                keys = samples[m][0].keys()
                median = {k: statistics.median(s[k] for s in samples[m]) for k in keys}
                rows.append({"length": n, "mode": m.partition("=")[0], **{k: round(v, 2) for k, v in median.items()}})
                print(json.dumps(rows[-1]), file=sys.stderr)
    native = {r["length"]: r["ttft"] for r in rows if r["mode"] == "native"}
    for r in rows:
        r["speedup_vs_native"] = round(native[r["length"]] / r["ttft"], 3) if r["length"] in native else None
    report = {
        "benchmark": "ttft", "canonical": args.canonical, "target": args.target,
        "repeats": args.repeats, "threads": args.threads, "dtype": args.dtype, "commit": git_commit(),
        "machine": machine_description(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/ttft.py " + " ".join(sys.argv[1:]), "rows": rows,
    }
    md = to_markdown(report)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md, encoding="utf-8")


def to_markdown(report: dict) -> str:
    lines = [
        f"### TTFT: {report['canonical']} -> {report['target']} (median of {report['repeats']})",
        "",
        f"- command: `{report['command']}`",
        f"- commit: {report['commit']}; machine: {report['machine']}; date: {report['date']}",
        "",
        "| context tokens | mode | " + " | ".join(TTFT_KEYS) + " | TTFT ms | native / mode |",
        "|" + "---|" * (len(TTFT_KEYS) + 4),
    ]
    for r in report["rows"]:
        cells = [str(r["length"]), r["mode"], *(f"{r[k]:.1f}" for k in TTFT_KEYS), f"{r['ttft']:.1f}",
                 "–" if r["speedup_vs_native"] is None else f"{r['speedup_vs_native']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
