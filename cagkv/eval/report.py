"""Turn per-example rows into the evaluation report (JSON) and its markdown table.

A row is one (example, mode): `{"id", "mode", "answer", "prediction", "em", "f1",
"answer_logprob", "ttft_ms", "timings_ms": {...}, ...}`. The report's top-level keys are
`dataset, canonical, target, n, modes` (mode -> metric -> value, with `<metric>_ci` =
[lo, hi]) and `recovery` (mode -> metric -> value, same convention), then `config`,
`kl_rows` and the per-example `examples` rows.
"""

from __future__ import annotations

import calendar
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from cagkv.eval.metrics import Interval, bootstrap_mean, normalize_answer, recovery, token_f1
from cagkv.pipeline import TIMING_KEYS

QUALITY_METRICS = ("em", "f1", "answer_logprob")
BASELINE_MODES = ("none", "native")


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _put(out: dict[str, Any], name: str, interval: Interval) -> None:
    out[name] = _num(interval.value)
    out[f"{name}_ci"] = interval.as_list()


def complete_ids(rows: Sequence[dict[str, Any]], modes: Sequence[str]) -> list[str]:
    """Ids with a row for every mode, in first-seen order: the paired sample reported."""
    have: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        have[row["id"]].add(row["mode"])
    return [i for i in dict.fromkeys(r["id"] for r in rows) if have[i] >= set(modes)]


def build_report(
    rows: Sequence[dict[str, Any]],
    *,
    dataset: str,
    canonical: str,
    target: str,
    modes: Sequence[str],
    config: dict[str, Any] | None = None,
    kl_rows: Sequence[dict[str, Any]] = (),
    n_boot: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Means with bootstrap intervals per mode and recovery per non-baseline mode."""
    ids = complete_ids(rows, modes)
    by_key = {(r["id"], r["mode"]): r for r in rows}

    def column(mode: str, metric: str) -> list[float | None]:
        return [by_key[(i, mode)].get(metric) for i in ids]

    summary: dict[str, dict[str, Any]] = {}
    for mode in modes:
        entry: dict[str, Any] = {"n": len(ids)}
        for metric in (*QUALITY_METRICS, "ttft_ms"):
            _put(entry, metric, bootstrap_mean(column(mode, metric), n_boot=n_boot, seed=seed))
        timings = [by_key[(i, mode)].get("timings_ms", {}) for i in ids]
        entry["timings_ms"] = {
            key: _num(bootstrap_mean([t.get(key) for t in timings], n_boot=1).value)
            for key in TIMING_KEYS
        }
        summary[mode] = entry

    kl = _kl_columns(kl_rows, modes)
    for mode, values in kl.items():
        _put(summary[mode], "kl", bootstrap_mean(values, n_boot=n_boot, seed=seed))

    rec: dict[str, dict[str, Any]] = {}
    if "none" in modes and "native" in modes:
        for mode in modes:
            if mode in BASELINE_MODES:
                continue
            entry = {}
            for metric in QUALITY_METRICS:
                interval = recovery(
                    column(mode, metric), column("none", metric), column("native", metric),
                    n_boot=n_boot, seed=seed,
                )
                _put(entry, metric, interval)
            if mode in kl and "none" in kl and "native" in kl:
                _put(entry, "kl", recovery(kl[mode], kl["none"], kl["native"], n_boot=n_boot, seed=seed))
            rec[mode] = entry

    agree = {}
    if "native" in modes:
        for mode in modes:
            if mode not in BASELINE_MODES:
                agree[mode] = agreement([by_key[(i, mode)] for i in ids], [by_key[(i, "native")] for i in ids])

    return {
        "dataset": dataset,
        "canonical": canonical,
        "target": target,
        "n": len(ids),
        "modes": summary,
        "recovery": rec,
        "agreement": agree,
        "config": dict(config or {}),
        "kl_rows": list(kl_rows),
        "examples": [by_key[(i, m)] for i in ids for m in modes],
    }


def agreement(rows: Sequence[dict[str, Any]], native: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How often a mode gives native's exact answer, for questions whose context was one
    retrieved chunk and for several (chunks are prefilled independently, so several chunks
    lack cross-chunk attention even in `canonical` mode)."""
    out: dict[str, Any] = {}
    for name, keep in (("single_chunk", lambda r: len(r.get("sources", [])) <= 1),
                       ("multi_chunk", lambda r: len(r.get("sources", [])) > 1)):
        pairs = [(r, n) for r, n in zip(rows, native) if keep(r)]
        diffs = [abs(r["answer_logprob"] - n["answer_logprob"]) for r, n in pairs
                 if r.get("answer_logprob") is not None and n.get("answer_logprob") is not None]
        out[name] = {
            "n": len(pairs),
            "same_answer": sum(r.get("prediction") == n.get("prediction") for r, n in pairs),
            "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 5) if diffs else None,
        }
    out["answers"] = answer_agreement(rows, native)
    return out


def answer_agreement(rows: Sequence[dict[str, Any]], native: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How close a mode's greedy answers are to native's, over every question: the same first
    word, token F1 against native's answer, and how often its F1 is above / below native's.
    A cache can give native's gold-answer likelihood and still send a long greedy answer
    elsewhere after a few words; this says where F1 recovery's noise comes from."""
    pairs = [(r, n) for r, n in zip(rows, native) if "prediction" in r and "prediction" in n]

    def first_word(text: str) -> list[str]:
        return normalize_answer(text).split()[:1]

    return {
        "n": len(pairs),
        "same_first_word": sum(first_word(r["prediction"]) == first_word(n["prediction"]) for r, n in pairs),
        "f1_vs_native": round(sum(token_f1(r["prediction"], [n["prediction"]]) for r, n in pairs) / len(pairs), 4)
        if pairs else None,
        "f1_above_native": sum(r.get("f1", 0.0) > n.get("f1", 0.0) for r, n in pairs),
        "f1_below_native": sum(r.get("f1", 0.0) < n.get("f1", 0.0) for r, n in pairs),
    }


def _kl_columns(kl_rows: Sequence[dict[str, Any]], modes: Sequence[str]) -> dict[str, list[float]]:
    """mode -> per-window KL, paired over the windows every mode has."""
    by_mode: dict[str, dict[int, float]] = defaultdict(dict)
    for row in kl_rows:
        by_mode[row["mode"]][int(row["window"])] = float(row["kl"])
    present = [m for m in modes if m in by_mode]
    if not present:
        return {}
    windows = sorted(set.intersection(*(set(by_mode[m]) for m in present)))
    return {m: [by_mode[m][w] for w in windows] for m in present}


# ---------------------------------------------------------------------------- markdown


def _pct(value: float | None, ci: list[float | None] | None = None) -> str:
    """A fraction as a percentage with one decimal, and its interval when known."""
    scaled_ci = [None if c is None else 100 * c for c in ci] if ci else ci
    return _plain(None if value is None else 100 * value, scaled_ci, digits=1)


def _plain(value: float | None, ci: list[float | None] | None = None, digits: int = 3) -> str:
    if value is None:
        return "–"
    text = f"{value:.{digits}f}"
    if ci and ci[0] is not None and ci[1] is not None:
        text += f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return text


SIDE_BY_SIDE_GAP_S = 60  # rows this close are one run's (a run of one question per mode has no overlap)


def _seconds(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%d %H:%M:%S UTC"))


def timing_groups(rows: Sequence[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """The modes whose rows were measured side by side, grouped: modes whose rows' measuring
    times overlap, within SIDE_BY_SIDE_GAP_S (one run interleaves its modes question by question;
    shards run at once), share a group; modes with rows written before rows carried a time
    (`measured`) form one group of their own.
    Each group: {"modes", "first", "last", "commits"} (first/last None for unstamped rows)."""
    spans: dict[str, tuple[str, str, set[str]] | None] = {}
    for mode in modes:
        stamps = [r.get("measured") for r in rows if r["mode"] == mode]
        if not stamps:
            continue
        if any(not st for st in stamps):
            spans[mode] = None
            continue
        times = sorted(st["at"] for st in stamps)
        spans[mode] = (times[0], times[-1], {str(st.get("commit")) for st in stamps})
    merged: list[dict[str, Any]] = []
    stamped = sorted(((span, m) for m, span in spans.items() if span is not None), key=lambda x: (x[0][:2], x[1]))
    for (first, last, commits), mode in stamped:
        if merged and _seconds(first) - _seconds(merged[-1]["last"]) <= SIDE_BY_SIDE_GAP_S:  # the spans overlap
            group = merged[-1]
            group["modes"].append(mode)
            group["last"] = max(group["last"], last)
            group["commits"] = sorted(set(group["commits"]) | commits)
        else:
            merged.append({"modes": [mode], "first": first, "last": last, "commits": sorted(commits)})
    unstamped = [m for m, span in spans.items() if span is None]
    return ([{"modes": unstamped, "first": None, "last": None, "commits": []}] if unstamped else []) + merged


def to_markdown(report: dict[str, Any]) -> str:
    """A markdown section: settings, quality per mode, recovery, and the TTFT split."""
    cfg = report.get("config", {})
    modes = report["modes"]
    lines = [
        f"### {report['dataset']}: {report['canonical']} -> {report['target']} (n = {report['n']})",
        "",
    ]
    for label, key in (("command", "command"), ("commit", "commit"), ("machine", "machine"),
                       ("retrieval", "retrieval"), ("seed", "seed"), ("date", "finished")):
        if cfg.get(key) is not None:
            value = f"`{cfg[key]}`" if key == "command" else str(cfg[key])
            lines.append(f"- {label}: {value}")
    for source in cfg.get("merged_from", []):  # benchmarks/merge_modes.py: rows of another run
        other = source.get("config", {})
        lines.append(f"- mode {source['mode']}: mode {source['from_mode']} of `{other.get('command')}` "
                     f"(commit {other.get('commit')}, {other.get('finished')})")
    lines += [
        "",
        "Quality per mode, mean with bootstrap 95 % interval (EM and F1 in %, answer log-prob in nats/token):",
        "",
    ]
    has_kl = any("kl" in m for m in modes.values())
    header = "| mode | EM | F1 | answer log-prob |" + (" KL (nats) |" if has_kl else "") + " TTFT ms |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for mode, m in modes.items():
        cells = [mode, _pct(m["em"], m["em_ci"]), _pct(m["f1"], m["f1_ci"]),
                 _plain(m["answer_logprob"], m["answer_logprob_ci"])]
        if has_kl:
            cells.append(_plain(m.get("kl"), m.get("kl_ci")))
        cells.append(_plain(m["ttft_ms"], None, digits=0))
        lines.append("| " + " | ".join(cells) + " |")
    groups = timing_groups(report.get("examples", []), list(modes))
    if len(groups) > 1:
        parts = [f"{', '.join(g['modes'])} " + (f"at {g['first']} to {g['last'][11:]} (commit {', '.join(g['commits'])})"
                                               if g["first"] else "(rows without a time, from earlier runs)")
                 for g in groups]
        lines += ["", "TTFT and the time split are **not side by side** across these groups of modes, measured apart "
                  "(rows resumed from earlier runs): " + "; ".join(parts) + ". Compare times with benchmarks/ttft.py."]
    if report["recovery"]:
        lines += ["", "Recovery = (mode - none) / (native - none), % with paired bootstrap 95 % interval:", ""]
        metrics = list(QUALITY_METRICS) + (["kl"] if has_kl else [])
        lines.append("| mode | " + " | ".join(metrics) + " |")
        lines.append("|" + "---|" * (len(metrics) + 1))
        for mode, r in report["recovery"].items():
            cells = [mode] + [_pct(r.get(k), r.get(f"{k}_ci")) for k in metrics]
            lines.append("| " + " | ".join(cells) + " |")
    if report.get("agreement"):
        lines += ["", "Same greedy answer as native (questions whose context was 1 chunk / several chunks; "
                  "mean |answer log-prob - native's|):", ""]
        lines += ["| mode | 1 chunk: same answer | 1 chunk: mean abs diff | several: same answer | several: mean abs diff |",
                  "|---|---|---|---|---|"]
        for mode, a in report["agreement"].items():
            one, many = a["single_chunk"], a["multi_chunk"]
            lines.append(f"| {mode} | {one['same_answer']} / {one['n']} | {_plain(one['mean_abs_logprob_diff'], digits=4)} "
                         f"| {many['same_answer']} / {many['n']} | {_plain(many['mean_abs_logprob_diff'], digits=4)} |")
        answers = {mode: a["answers"] for mode, a in report["agreement"].items() if a.get("answers")}
        if answers:
            lines += ["", "Greedy answers against native's, every question (token F1 of the answer against "
                      "native's answer; questions whose F1 is above / below native's):", ""]
            lines += ["| mode | same first word | F1 against native's answer | F1 above native's | F1 below native's |",
                      "|---|---|---|---|---|"]
            for mode, a in answers.items():
                lines.append(f"| {mode} | {a['same_first_word']} / {a['n']} | {_plain(a['f1_vs_native'], digits=3)} "
                             f"| {a['f1_above_native']} | {a['f1_below_native']} |")
    lines += ["", "Time to first token split, mean ms per question (first_token is the time from the "
              "question to the first token, so it includes the phases to its left; total includes "
              "the whole answer):", ""]
    lines.append("| mode | " + " | ".join(TIMING_KEYS) + " |")
    lines.append("|" + "---|" * (len(TIMING_KEYS) + 1))
    for mode, m in modes.items():
        cells = [mode] + [_plain(m["timings_ms"].get(k), None, digits=1) for k in TIMING_KEYS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
