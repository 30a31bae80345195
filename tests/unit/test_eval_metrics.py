"""Metrics, datasets and report: hand-worked examples and synthetic inputs, no models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cagkv.errors import UsageError
from cagkv.eval.datasets import load_dataset, read_examples, sample_examples, unique_contexts
from cagkv.eval.metrics import (
    answer_span,
    bootstrap_mean,
    exact_match,
    normalize_answer,
    recovery,
    recovery_difference,
    recovery_ratio,
    token_f1,
)
from cagkv.eval.report import build_report, complete_ids, to_markdown

# ------------------------------------------------------------------ normalisation, EM, F1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Denver Broncos!", "denver broncos"),
        ("  an   Apple, a day ", "apple day"),
        ("Theater", "theater"),  # 'the' only as a whole word
        ("U.S.A.", "usa"),
        ("", ""),
        ("A", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_exact_match_any_gold() -> None:
    assert exact_match("the Broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert exact_match("Denver", ["Denver Broncos", "Broncos"]) == 0.0


def test_f1_hand_worked() -> None:
    # pred tokens {denver, broncos, won}; gold {denver, broncos}: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("Denver Broncos won", ["Denver Broncos"]) == pytest.approx(0.8)
    # repeated tokens count once per occurrence: pred "a b b" vs gold "b b c" after normalisation
    # ("a" is an article, dropped): pred [b, b], gold [b, b, c]: P = 1, R = 2/3, F1 = 0.8
    assert token_f1("a b b", ["b b c"]) == pytest.approx(0.8)
    assert token_f1("cat", ["dog"]) == 0.0


def test_f1_takes_best_gold() -> None:
    golds = ["Carolina Panthers", "the Panthers", "Panthers of Carolina"]
    # vs "the Panthers" -> [panthers] exact -> 1.0, beats the others
    assert token_f1("Panthers", golds) == 1.0
    # "Carolina" vs gold 1: P 1, R 1/2 -> 2/3; vs gold 3 [panthers, of, carolina]: P1 R1/3 -> 0.5
    assert token_f1("Carolina", golds) == pytest.approx(2 / 3)


def test_f1_empty_cases() -> None:
    assert token_f1("", ["answer"]) == 0.0
    assert token_f1("the", ["a"]) == 1.0  # both normalise to nothing
    assert token_f1("x", []) == 0.0


def test_answer_span_first_line() -> None:
    assert answer_span("\n  Denver Broncos \nQuestion: who") == "Denver Broncos"
    assert answer_span("   ") == ""


# ------------------------------------------------------------------ bootstrap and recovery


def test_bootstrap_mean_contains_mean_and_is_seeded() -> None:
    values = list(np.random.default_rng(1).normal(2.0, 1.0, size=400))
    a = bootstrap_mean(values, seed=3)
    b = bootstrap_mean(values, seed=3)
    assert a == b
    assert a.lo < a.value < a.hi
    assert a.value == pytest.approx(float(np.mean(values)))
    # the 95 % interval of a mean of 400 N(2, 1) draws is about +-1.96/20 = +-0.098
    assert 0.15 < a.hi - a.lo < 0.25


def test_bootstrap_mean_drops_missing_and_handles_empty() -> None:
    assert bootstrap_mean([1.0, None, float("nan"), 3.0]).value == 2.0
    empty = bootstrap_mean([None])
    assert math.isnan(empty.value) and empty.as_list() == [None, None]


def test_bootstrap_constant_values_give_zero_width() -> None:
    interval = bootstrap_mean([0.5] * 50)
    assert interval.lo == interval.hi == 0.5


def test_recovery_ratio_arithmetic() -> None:
    assert recovery_ratio(0.5, 0.2, 0.8) == pytest.approx(0.5)
    assert recovery_ratio(0.8, 0.2, 0.8) == pytest.approx(1.0)
    assert recovery_ratio(0.2, 0.2, 0.8) == pytest.approx(0.0)
    assert recovery_ratio(0.1, 0.2, 0.8) == pytest.approx(-1 / 6)
    assert math.isnan(recovery_ratio(0.5, 0.4, 0.4))
    # lower-is-better metrics work too: KL none 2.0, native 0, mode 0.5 -> 75 %
    assert recovery_ratio(0.5, 2.0, 0.0) == pytest.approx(0.75)


def test_recovery_paired_interval_on_synthetic_data() -> None:
    rng = np.random.default_rng(0)
    n = 300
    difficulty = rng.normal(0.0, 1.0, size=n)  # shared per-example effect, cancels when paired
    none = difficulty
    native = difficulty + 1.0 + rng.normal(0, 0.1, size=n)
    mode = difficulty + 0.6 + rng.normal(0, 0.1, size=n)
    r = recovery(list(mode), list(none), list(native), seed=0)
    assert r.value == pytest.approx((mode.mean() - none.mean()) / (native.mean() - none.mean()))
    assert r.lo < 0.6 < r.hi
    # paired resampling: the big shared effect does not widen the interval
    assert r.hi - r.lo < 0.05


def test_recovery_identity_cases() -> None:
    none = [0.0, 0.0, 1.0, 0.0]
    native = [1.0, 1.0, 1.0, 0.0]
    full = recovery(native, none, native)
    assert full.value == pytest.approx(1.0)
    assert full.lo == pytest.approx(1.0) and full.hi == pytest.approx(1.0)
    assert recovery(none, none, native).value == pytest.approx(0.0)


def test_recovery_undefined_and_mismatched() -> None:
    same = [0.3, 0.6]
    assert math.isnan(recovery(same, same, same).value)
    with pytest.raises(ValueError):
        recovery([1.0], [1.0, 2.0], [1.0])


def test_recovery_drops_examples_missing_in_any_mode() -> None:
    r = recovery([0.5, None], [0.0, 0.0], [1.0, 0.0])
    assert r.value == pytest.approx(0.5)


# ------------------------------------------------------------------ datasets


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _rows(n: int) -> list[dict]:
    return [
        {"id": f"q{i}", "dataset": "toy", "context": f"ctx {i // 2}", "question": f"q {i}?",
         "answers": [f"a{i}"], "answer_type": "extractive", "meta": {"i": i}}
        for i in range(n)
    ]


def test_read_and_sample(tmp_path) -> None:
    path = tmp_path / "toy.jsonl"
    _write(path, _rows(20))
    examples = read_examples(path)
    assert [e.id for e in examples] == [f"q{i}" for i in range(20)]
    assert examples[3].answers == ("a3",) and examples[3].meta == {"i": 3}
    a = sample_examples(examples, 5, seed=7)
    assert a == sample_examples(examples, 5, seed=7)
    assert a != sample_examples(examples, 5, seed=8)
    # the sample of 5 is a prefix of the sample of 10 with the same seed
    assert sample_examples(examples, 10, seed=7)[:5] == a
    assert len(load_dataset(path, limit=None, seed=0)) == 20
    assert unique_contexts(examples[:5]) == ["ctx 0", "ctx 1", "ctx 2"]


def test_max_context_chars_filters_before_sampling(tmp_path) -> None:
    path = tmp_path / "lengths.jsonl"
    rows = _rows(12)
    for i, row in enumerate(rows):
        row["context"] = "x" * (10 * (i + 1))  # 10, 20, ..., 120 characters
    _write(path, rows)
    short = load_dataset(path, limit=None, seed=0, max_context_chars=50)
    assert sorted(e.id for e in short) == [f"q{i}" for i in range(5)]
    # the seeded sample is drawn among the short ones
    assert load_dataset(path, limit=3, seed=1, max_context_chars=50) == load_dataset(
        path, limit=None, seed=1, max_context_chars=50)[:3]
    with pytest.raises(UsageError, match="at most 5 characters"):
        load_dataset(path, max_context_chars=5)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        (json.dumps({"id": "x", "context": "c", "question": "q"}), "missing keys"),
        (json.dumps({"id": "x", "context": "c", "question": "q", "answers": []}), "non-empty list"),
        (json.dumps({"id": "x", "context": "c", "question": " ", "answers": ["a"]}), "empty question"),
    ],
)
def test_read_rejects_bad_lines(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(UsageError, match=message):
        read_examples(path)


def test_read_rejects_missing_file_and_duplicates(tmp_path) -> None:
    with pytest.raises(UsageError, match="not found"):
        read_examples(tmp_path / "nope.jsonl")
    path = tmp_path / "dup.jsonl"
    _write(path, _rows(2) + _rows(1))
    with pytest.raises(UsageError, match="duplicate id"):
        read_examples(path)
    with pytest.raises(UsageError, match="positive"):
        sample_examples([], 0)


# ------------------------------------------------------------------ report


def _synthetic_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        for mode, em, f1, lp in (("none", 0.0, 0.1, -3.0), ("native", 1.0, 0.9, -1.0),
                                 ("translate", float(i % 2), 0.5, -2.0)):
            rows.append({"id": f"q{i}", "mode": mode, "em": em, "f1": f1, "answer_logprob": lp,
                         "ttft_ms": 10.0, "timings_ms": {"prefill": 4.0, "first_token": 6.0}})
    return rows


def test_report_keys_values_and_recovery() -> None:
    rows = _synthetic_rows(10)
    rows.append({"id": "partial", "mode": "none", "em": 0.0, "f1": 0.0, "answer_logprob": -1.0})
    kl_rows = [{"mode": m, "window": w, "kl": k} for w in range(4)
               for m, k in (("none", 2.0), ("native", 0.0), ("translate", 0.5))]
    report = build_report(rows, dataset="toy", canonical="a", target="b",
                          modes=["none", "native", "translate"], kl_rows=kl_rows)
    assert {"dataset", "canonical", "target", "n", "modes", "recovery", "examples"} <= set(report)
    assert report["n"] == 10  # the partial example is not paired, so not counted
    assert len(report["examples"]) == 30
    assert report["modes"]["native"]["em"] == 1.0
    assert report["modes"]["translate"]["em"] == pytest.approx(0.5)
    assert report["modes"]["native"]["timings_ms"]["prefill"] == 4.0
    assert report["modes"]["native"]["timings_ms"]["load"] is None
    rec = report["recovery"]["translate"]
    assert set(rec) >= {"em", "em_ci", "f1", "f1_ci", "answer_logprob", "answer_logprob_ci", "kl"}
    assert rec["em"] == pytest.approx(0.5)
    assert rec["f1"] == pytest.approx(0.5)
    assert rec["answer_logprob"] == pytest.approx(0.5)
    assert rec["kl"] == pytest.approx(0.75)
    assert "none" not in report["recovery"] and "native" not in report["recovery"]
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN anywhere
    md = to_markdown(report)
    assert "| translate |" in md and "Recovery" in md and "n = 10" in md


def test_the_report_says_when_its_time_columns_were_not_measured_side_by_side() -> None:
    from cagkv.eval.report import timing_groups

    rows = _synthetic_rows(3)
    md = to_markdown(build_report(rows, dataset="t", canonical="a", target="b", modes=["none", "native", "translate"]))
    assert "not side by side" not in md  # no times at all: one group, nothing to say
    for k, row in enumerate(rows):  # none and native in one run, question by question...
        row["measured"] = {"at": f"2026-12-07 02:{10 + k // 3:02d}:00 UTC", "commit": "abc"}
    for row in rows:  # ...translate resumed from a run of the day before
        if row["mode"] == "translate":
            row["measured"] = {"at": "2026-12-06 20:00:00 UTC", "commit": "old"}
    groups = timing_groups(rows, ["none", "native", "translate"])
    assert [g["modes"] for g in groups] == [["translate"], ["native", "none"]]
    assert groups[1]["first"] == "2026-12-07 02:10:00 UTC" and groups[1]["commits"] == ["abc"]
    md = to_markdown(build_report(rows, dataset="t", canonical="a", target="b", modes=["none", "native", "translate"]))
    assert "**not side by side**" in md and "translate at 2026-12-06 20:00:00 UTC" in md
    rows[-1].pop("measured")  # one row of translate without a time: the mode counts as an earlier run's
    assert timing_groups(rows, ["none", "native", "translate"])[0] == {"modes": ["translate"], "first": None,
                                                                       "last": None, "commits": []}
    for row in rows:  # everything in one run: one group
        row["measured"] = {"at": "2026-12-07 02:10:00 UTC", "commit": "abc"}
    assert len(timing_groups(rows, ["none", "native", "translate"])) == 1


def test_report_without_baselines_has_no_recovery() -> None:
    rows = [r for r in _synthetic_rows(3) if r["mode"] != "none"]
    report = build_report(rows, dataset="t", canonical="a", target="b", modes=["native", "translate"])
    assert report["recovery"] == {}
    assert complete_ids(rows, ["native", "translate"]) == ["q0", "q1", "q2"]


def test_agreement_splits_single_and_multi_chunk_questions() -> None:
    from cagkv.eval.report import agreement

    native = [{"prediction": "a", "answer_logprob": -1.0, "sources": ["d"]},
              {"prediction": "b", "answer_logprob": -2.0, "sources": ["d", "d"]},
              {"prediction": "c", "answer_logprob": -3.0, "sources": ["d", "d"]}]
    mode = [{"prediction": "a", "answer_logprob": -1.0, "sources": ["d"]},
            {"prediction": "x", "answer_logprob": -2.5, "sources": ["d", "d"]},
            {"prediction": "c", "answer_logprob": -2.5, "sources": ["d", "d"]}]
    a = agreement(mode, native)
    assert a["single_chunk"] == {"n": 1, "same_answer": 1, "mean_abs_logprob_diff": 0.0}
    assert a["multi_chunk"] == {"n": 2, "same_answer": 1, "mean_abs_logprob_diff": 0.5}
    assert a["answers"]["n"] == 3 and a["answers"]["same_first_word"] == 2


def test_answer_agreement_compares_greedy_answers_with_natives() -> None:
    from cagkv.eval.report import answer_agreement

    native = [{"prediction": "The Seine river", "f1": 0.5}, {"prediction": "Paris", "f1": 1.0},
              {"prediction": "in 1912", "f1": 0.0}]
    mode = [{"prediction": "the Seine", "f1": 1.0}, {"prediction": "Lyon, France", "f1": 0.0},
            {"prediction": "In 1912", "f1": 0.0}]
    a = answer_agreement(mode, native)
    # "the"/"The" and "In"/"in" are the same first word once normalised (articles dropped: "seine")
    assert a["n"] == 3 and a["same_first_word"] == 2
    assert a["f1_vs_native"] == round((2 / 3 + 0.0 + 1.0) / 3, 4)  # "seine" against "seine river"
    assert (a["f1_above_native"], a["f1_below_native"]) == (1, 1)


def test_needle_grid_and_length_table() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from plot_needle import length_table, needle_grid

    meta = {"a": {"context_chars_budget": 2000, "depth_percent": 0},
            "b": {"context_chars_budget": 2000, "depth_percent": 50},
            "c": {"context_chars_budget": 4000, "depth_percent": 0}}
    report = {"examples": [
        {"id": "a", "mode": "native", "f1": 1.0}, {"id": "b", "mode": "native", "f1": 0.5},
        {"id": "c", "mode": "native", "f1": 0.0}, {"id": "a", "mode": "r0", "f1": 0.25},
        {"id": "zzz", "mode": "r0", "f1": 1.0},  # not in the dataset's meta: ignored
    ]}
    grid = needle_grid(report, meta)
    assert grid == {"native": {(2000, 0): 1.0, (2000, 50): 0.5, (4000, 0): 0.0}, "r0": {(2000, 0): 0.25}}
    table = length_table(grid, ["native", "r0"]).splitlines()
    assert table[2] == "| 2000 | 75 (n=2) | 25 (n=1) |"
    assert table[3] == "| 4000 | 0 (n=1) | - |"


def test_recovery_difference_is_paired() -> None:
    rng = np.random.default_rng(0)
    none = rng.normal(-5.0, 1.0, 200)
    native = none + rng.normal(3.0, 1.0, 200)
    noise = rng.normal(0.0, 2.0, 200)  # large per-question noise shared by both modes
    a = none + 0.7 * (native - none) + noise
    b = none + 0.6 * (native - none) + noise
    d = recovery_difference(a, b, none, native, n_boot=500, seed=0)
    assert d.value == pytest.approx(recovery(a, none, native).value - recovery(b, none, native).value)
    assert d.value == pytest.approx(0.1, abs=0.01)
    assert 0.0 < d.lo < d.value < d.hi  # the shared noise cancels: the difference is resolved
    sep_a, sep_b = recovery(a, none, native, n_boot=500), recovery(b, none, native, n_boot=500)
    assert sep_a.lo < sep_b.hi  # while the separate intervals overlap
    same = recovery_difference(a, a, none, native, n_boot=100)
    assert (same.value, same.lo, same.hi) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="equal lengths"):
        recovery_difference(a[:3], b, none, native)
    # b against a reference of its own (native run another way): each recovery against its native
    other = none + 1.5 * (native - none)
    own = recovery_difference(a, b, none, native, n_boot=500, native_b=other)
    assert own.value == pytest.approx(recovery(a, none, native).value - recovery(b, none, other).value)
    assert own.value == pytest.approx(0.7 - 0.6 / 1.5, abs=0.02)


def test_compare_modes_pairs_two_modes_over_a_range_of_the_questions() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from compare_modes import compare, parse_rows

    rng = np.random.default_rng(1)
    examples = []
    for q in range(40):  # mode "a" recovers all of native's gain on the first 20 questions, none after
        none, native = float(rng.normal(-5, 1)), float(rng.normal(-2, 1))
        rows = {"none": none, "native": native, "a": native if q < 20 else none, "b": none + 0.5 * (native - none)}
        examples += [{"id": f"q{q}", "mode": m, "f1": 0.0, "em": 0.0, "answer_logprob": v} for m, v in rows.items()]
    report = {"examples": examples}
    first, second = (compare(report, "a", "b", n_boot=200, rows=parse_rows(r)) for r in (":20", "20:"))
    assert first["answer_logprob"][0] == pytest.approx(0.5) and second["answer_logprob"][0] == pytest.approx(-0.5)
    assert first["n"][0] == second["n"][0] == 20
    assert compare(report, "a", "b", n_boot=200)["n"][0] == 40
    assert "f1_vs_native" not in first  # no greedy answers in these rows
    answers = {"native": "the red fox", "a": "the red fox", "b": "a blue whale", "none": "no"}
    for r in examples:
        r["prediction"] = answers[r["mode"]] if int(r["id"][1:]) < 20 else "the red fox"
    agree = compare(report, "a", "b", n_boot=200, rows=parse_rows(":20"))["f1_vs_native"]
    assert agree[0] == pytest.approx(1.0) and agree[1] == pytest.approx(1.0)  # a says native's answer, b shares no token
    assert compare(report, "a", "b", n_boot=200, rows=parse_rows("20:"))["f1_vs_native"][0] == 0.0
    assert parse_rows("300:600") == slice(300, 600) and parse_rows(":") == slice(None, None)
    for bad in ("300", "a:b"):
        with pytest.raises(SystemExit, match="--rows"):
            parse_rows(bad)


def test_ttft_benchmark_mode_specs(tmp_path) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from ttft import parse_mode

    from cagkv.eval.runner import Variant

    assert parse_mode("native") == ("native", "native", Variant("native", None, False), None)
    assert parse_mode("r2=translate@2") == ("r2", "translate", Variant("translate", 2, False), None)
    assert parse_mode("cc=translate") == ("cc", "translate", Variant("translate", None, False), None)
    assert parse_mode(f"cc0={tmp_path}@0") == ("cc0", "translate", Variant(str(tmp_path), 0, False), str(tmp_path))
    assert parse_mode(f"w={tmp_path}@window") == ("w", "mot-window", Variant(str(tmp_path), None, True), str(tmp_path))
    assert parse_mode("q=translate@refresh0.25") == ("q", "translate", Variant("translate", 0, False, 0.25), None)
    with pytest.raises(SystemExit, match="neither a mode"):
        parse_mode(f"x={tmp_path / 'missing'}@0")
    with pytest.raises(SystemExit, match="expected a replay count.*folder goes before"):
        parse_mode(f"lin=translate@{tmp_path}")  # the folder belongs before '@'
    with pytest.raises(SystemExit, match="replay must be >= 0"):
        parse_mode("r=translate@-1")
    assert parse_mode("w=translate@window") == ("w", "mot-window", Variant("translate", None, True), None)


def test_ttft_benchmark_measures_the_bias_and_its_scope_the_mode_names() -> None:
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from ttft import measure, parse_mode

    class Engine:  # records what the benchmark asks the engine for
        def prepare(self, question, **kwargs):
            self.kwargs = kwargs
            return SimpleNamespace(next_position=7)

        def generate(self, prepared, max_new_tokens):
            return SimpleNamespace(timings_ms={"first_token": 5.0})

    engine = Engine()
    _, mode, variant, _ = parse_mode("a=translate@0+bias-0.25+answer4+rest:full")
    split = measure(engine, "t", mode, variant, "doc", 3)
    assert engine.kwargs["attention_bias"] == -0.25 and engine.kwargs["attention_bias_scope"] == "answer4,rest:full"
    assert split["ttft"] == 5.0 and split["context_tokens"] == 7.0


def test_ttft_benchmark_rows_per_linear_dtype() -> None:
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from ttft import expand_linear_dtypes

    specs, linear = expand_linear_dtypes(["native", "r0=translate@0"], "float32,bfloat16,bfloat16-unfolded")
    assert list(specs) == ["native", "r0:float32", "r0:bfloat16", "r0:bfloat16-unfolded"]
    assert linear == {"native": None, "r0:float32": (torch.float32, True), "r0:bfloat16": (torch.bfloat16, True),
                      "r0:bfloat16-unfolded": (torch.bfloat16, False)}
    assert specs["r0:bfloat16"][1:] == specs["r0:float32"][1:]  # same mode, only the dtype differs
    specs, linear = expand_linear_dtypes(["native", "r0=translate@0"], None)
    assert list(specs) == ["native", "r0"] and set(linear.values()) == {None}
    with pytest.raises(SystemExit, match="is not one of"):
        expand_linear_dtypes(["r0=translate@0"], "float16")


def test_oracle_layers_hybrid_takes_exactly_the_named_layers_and_parts() -> None:
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from oracle_layers import hybrid, hybrid_splits, layer_set_split

    splits = hybrid_splits([[1, 2], [3]], 4)
    assert splits["g0"] == ([1, 2], "kv") and splits["g1"] == ([3], "kv")
    assert splits["low0.33"] == ([0], "kv") and splits["high0.67"] == ([1, 2, 3], "kv")
    assert splits["K"] == ([0, 1, 2, 3], "k") and splits["V"] == ([0, 1, 2, 3], "v")
    assert layer_set_split("l3+1", 4) == ([1, 3], "kv") and layer_set_split("k2", 4) == ([2], "k")
    assert layer_set_split("v0+0", 4) == ([0], "v") and layer_set_split("g0", 4) is None
    with pytest.raises(ValueError, match="0..3"):
        layer_set_split("l4", 4)

    def prepared(fill: float) -> SimpleNamespace:
        layers = [SimpleNamespace(keys=torch.full((1, 2, 5, 4), fill + l), values=torch.full((1, 2, 5, 4), -fill - l))
                  for l in range(4)]
        return SimpleNamespace(cache=SimpleNamespace(layers=layers), next_position=5)

    tr, nat = prepared(0.0), prepared(100.0)
    mixed = hybrid(tr, nat, [1, 3], "k")
    for l in range(4):
        want_k = nat if l in (1, 3) else tr
        assert torch.equal(mixed.cache.layers[l].keys, want_k.cache.layers[l].keys)
        assert torch.equal(mixed.cache.layers[l].values, tr.cache.layers[l].values)
    assert float(tr.cache.layers[1].keys[0, 0, 0, 0]) == 1.0  # the translated cache is left as it was
    # token sets: every layer, only the named positions, keys and values
    from oracle_layers import token_hybrid, token_positions

    tokens = token_hybrid(tr, nat, [1, 4])
    for l in range(4):
        for p in range(5):
            src = nat if p in (1, 4) else tr
            assert torch.equal(tokens.cache.layers[l].keys[:, :, p], src.cache.layers[l].keys[:, :, p])
            assert torch.equal(tokens.cache.layers[l].values[:, :, p], src.cache.layers[l].values[:, :, p])
    assert float(tr.cache.layers[0].keys[0, 0, 1, 0]) == 0.0
    assert token_positions("tfirst", tr, nat, 1, 0.5) == [1, 2] and token_positions("tlast", tr, nat, 1, 0.5) == [3, 4]
    both = hybrid(tr, nat, [2], "kv")
    assert torch.equal(both.cache.layers[2].values, nat.cache.layers[2].values)
    nat.cache.layers[0].keys = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match="layer 0"):
        hybrid(tr, nat, [0], "kv")


def test_merge_modes_scores_another_runs_rows_against_the_same_baselines() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from merge_modes import merge, parse_add

    from cagkv.eval.report import to_markdown

    rows = _synthetic_rows(4)
    base = build_report(rows, dataset="t", canonical="a", target="b", modes=["none", "native", "translate"],
                        config={"command": "cagkv eval base", "seed": 0})
    other_rows = [{**r, "f1": r["f1"] * 0.5} for r in rows if r["mode"] == "native"]
    other = build_report(other_rows, dataset="t", canonical="a", target="b", modes=["native"],
                         config={"command": "cagkv eval --dtype bfloat16", "commit": "abc"})
    merged = merge(base, [(other, "native", "native_bf16")], ["none", "native", "native_bf16", "translate"],
                   n_boot=50)
    assert merged["n"] == 4 and set(merged["recovery"]) == {"native_bf16", "translate"}
    assert merged["recovery"]["translate"]["f1"] == base["recovery"]["translate"]["f1"]
    assert merged["recovery"]["native_bf16"]["f1"] == pytest.approx((0.45 - 0.1) / (0.9 - 0.1))
    natives = {r["id"]: r["f1"] for r in merged["examples"] if r["mode"] == "native"}
    halves = {r["id"]: r["f1"] for r in merged["examples"] if r["mode"] == "native_bf16"}
    assert halves == {i: f * 0.5 for i, f in natives.items()}
    assert "mode native_bf16: mode native of `cagkv eval --dtype bfloat16`" in to_markdown(merged)
    assert parse_add("x/r.json:native=n2") == (Path("x/r.json"), "native", "n2")
    for bad in ("x/r.json", "x/r.json:native", "x/r.json:=n2"):
        with pytest.raises(SystemExit):
            parse_add(bad)
    with pytest.raises(SystemExit, match="already"):
        merge(base, [(other, "native", "translate")], ["none", "native", "translate"])
