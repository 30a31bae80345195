"""Put modes of several `cagkv eval --out` JSONs into one report, so that rows made with other
settings (another `--dtype`, say) are scored against the same none / native rows.

`cagkv eval` resumes only rows made with its own settings; a control such as native prefill
in bfloat16 is therefore its own run. This joins such runs by question id, renames the
modes taken from them, and rebuilds the report (recovery, intervals, agreement with native)
over the questions every mode has. `benchmarks/compare_modes.py` then pairs any two of them.

Example (E83):
    python benchmarks/merge_modes.py docs/results/squad_e82_smollm2_gemma3.json \\
        --add docs/results/squad_e83_bf16_smollm2_gemma3.json:native=native_bf16 \\
        --modes none,native,native_bf16,c33 --out docs/results/squad_e83_smollm2_gemma3.json \\
        --markdown docs/results/squad_e83_smollm2_gemma3.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cagkv.eval.report import build_report, to_markdown


def parse_add(spec: str) -> tuple[Path, str, str]:
    """`"FILE:MODE=NEW"` -> (file, mode, new name)."""
    path, sep, rename = spec.rpartition(":")
    mode, eq, new = rename.partition("=")
    if not sep or not eq or not mode or not new:
        raise SystemExit(f"--add: expected FILE:MODE=NEW_NAME, got {spec!r}")
    return Path(path), mode, new


def merge(base: dict[str, Any], added: list[tuple[dict[str, Any], str, str]], modes: list[str],
          n_boot: int = 2000) -> dict[str, Any]:
    """The report over `modes`, from `base`'s rows and each (report, mode, new name) added."""
    rows = [r for r in base["examples"] if r["mode"] in modes]
    taken = {r["mode"] for r in rows}
    sources = []
    for report, mode, new in added:
        if new in taken:
            raise SystemExit(f"mode {new!r} is in the base file already: give another name")
        if report["canonical"] != base["canonical"] or report["target"] != base["target"]:
            raise SystemExit(f"{mode}: rows of {report['canonical']} -> {report['target']}, the base file has "
                             f"{base['canonical']} -> {base['target']}")
        picked = [{**r, "mode": new} for r in report["examples"] if r["mode"] == mode]
        if not picked:
            raise SystemExit(f"no rows of mode {mode!r} to add")
        rows += picked
        taken.add(new)
        sources.append({"mode": new, "from_mode": mode, "config": report.get("config", {})})
    missing = [m for m in modes if m not in taken]
    if missing:
        raise SystemExit(f"no rows for mode(s) {', '.join(missing)}")
    config = {**base.get("config", {}), "modes": modes, "merged_from": sources}
    return build_report(rows, dataset=base["dataset"], canonical=base["canonical"], target=base["target"],
                        modes=modes, config=config, n_boot=n_boot, seed=int(config.get("seed", 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="eval JSON whose settings the report keeps")
    parser.add_argument("--add", action="append", default=[], help="FILE:MODE=NEW_NAME (repeatable)")
    parser.add_argument("--modes", required=True, help="comma-separated modes of the merged report")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    base = json.loads(args.base.read_text(encoding="utf-8"))
    added = []
    for spec in args.add:
        path, mode, new = parse_add(spec)
        added.append((json.loads(path.read_text(encoding="utf-8")), mode, new))
    report = merge(base, added, [m.strip() for m in args.modes.split(",") if m.strip()])
    args.out.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    text = to_markdown(report)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
