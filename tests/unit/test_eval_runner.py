"""The evaluation runner end to end on tiny random models, a hash embedder and temp stores."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from cagkv.eval.runner import EvalConfig, PartialResults, answer_ids, run_eval
from cagkv.errors import UsageError
from cagkv.pipeline import CAG
from cagkv.prefill import prefill_chunks
from cagkv.prompt import PromptFormat
from engine_helpers import make_model_dir

CONTEXTS = [
    "The lighthouse keeper lived on the island for thirty years. Every night he lit the lamp.",
    "Paris is the capital of France. It is known for the Eiffel Tower. The river is the Seine.",
    "In 1912 the ship sailed from Southampton to New York with many people on board.",
]
QUESTIONS = [
    (0, "How long did the keeper live there?", ["thirty years"]),
    (0, "What did he light?", ["the lamp", "lamp"]),
    (1, "What is the capital of France?", ["Paris"]),
    (1, "Which river flows there?", ["the Seine"]),
    (2, "Where did the ship sail to?", ["New York"]),
]
KL_TEXT = " ".join(
    "Alice was beginning to get very tired of sitting by her sister on the bank. "
    "The quick brown fox jumps over the lazy dog. Is it raining? Yes, it is raining today."
    .split(". ") * 3
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models: thread start-up dominates, and the shared CPU is oversubscribed
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("cagkv_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAGKV_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def models(home):
    return {
        "llama": str(make_model_dir(home / "m", "llama", chat=True)),
        "gemma": str(make_model_dir(home / "m", "gemma3_text", chat=False)),
    }


@pytest.fixture()
def dataset(tmp_path):
    path = tmp_path / "toy.jsonl"
    rows = [
        {"id": f"q{i}", "dataset": "toy", "context": CONTEXTS[c], "question": q, "answers": a,
         "answer_type": "extractive", "meta": {}}
        for i, (c, q, a) in enumerate(QUESTIONS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def config(dataset, models, tmp_path, **kw) -> EvalConfig:
    base = dict(dataset=str(dataset), canonical=models["llama"], target=models["llama"],
                modes=["none", "native", "canonical"], seed=1, max_new_tokens=4, n_boot=200,
                dtype="float32", ingest_dtype="float32", embedder="hash-64",
                out=str(tmp_path / "out" / "results.json"), markdown=str(tmp_path / "out" / "results.md"))
    base.update(kw)
    return EvalConfig(**base)


def quality(report):
    return {(r["id"], r["mode"]): (r["prediction"], r["em"], r["f1"], r["answer_logprob"])
            for r in report["examples"]}


def test_report_has_every_key_and_canonical_matches_native(dataset, models, tmp_path):
    cfg = config(dataset, models, tmp_path, store=str(tmp_path / "evalstore"))
    report = run_eval(cfg, progress=False)
    assert {"dataset", "canonical", "target", "n", "modes", "recovery", "examples"} <= set(report)
    assert report["dataset"] == "toy" and report["n"] == len(QUESTIONS)
    for mode in cfg.modes:
        m = report["modes"][mode]
        for key in ("em", "f1", "answer_logprob", "ttft_ms", "em_ci", "f1_ci", "answer_logprob_ci"):
            assert key in m
        assert set(m["timings_ms"]) >= {"retrieve", "load", "translate", "replay", "prefill", "first_token"}
    assert set(report["recovery"]) == {"canonical"}
    assert set(report["recovery"]["canonical"]) >= {"em", "f1", "answer_logprob", "f1_ci"}
    rows = {(r["id"], r["mode"]): r for r in report["examples"]}
    assert len(rows) == len(QUESTIONS) * 3
    for (qid, mode), row in rows.items():
        assert {"prediction", "em", "f1", "answer_logprob", "ttft_ms", "timings_ms", "sources"} <= set(row)
        if mode != "none":
            assert row["retrieval_hit"] is True  # oracle retrieval: the example's own context
        # canonical mode (float32 ingest) is the same cache as a native prefill
        if mode == "canonical":
            native = rows[(qid, "native")]
            assert row["answer_logprob"] == pytest.approx(native["answer_logprob"], abs=2e-3)
            assert row["prediction"] == native["prediction"]
    assert report["recovery"]["canonical"]["answer_logprob"] == pytest.approx(1.0, abs=0.02)
    # the none mode reads no document, so its gold log-prob differs from native
    assert any(abs(rows[(i, "none")]["answer_logprob"] - rows[(i, "native")]["answer_logprob"]) > 1e-2
               for i in {q for q, _ in rows})
    # contexts shared by several questions are ingested once
    from cagkv.stores import CacheStore

    store = CacheStore.open(tmp_path / "evalstore" / "store", create=False)
    assert len(store.list_documents()) == len(CONTEXTS)
    store.close()
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["n"] == report["n"] and saved["config"]["header"]["seed"] == 1
    assert not (tmp_path / "out" / "results.json.partial.jsonl").exists()
    assert "| canonical |" in (tmp_path / "out" / "results.md").read_text()


def test_answer_logprob_equals_a_plain_forward(dataset, models, tmp_path):
    """Teacher forcing after the prepared cache == one forward over prompt + answer."""
    from cagkv.eval.runner import answer_logprob
    from cagkv.ingest import ingest_text
    from cagkv.models import load
    from cagkv.stores import CacheStore

    loaded = load(models["gemma"])
    store = CacheStore.open(tmp_path / "s", canonical=models["gemma"], fingerprint=loaded.fingerprint,
                            embedder="hash-64")
    doc = ingest_text(store, CONTEXTS[1], "d", loaded=loaded).document_id
    cag = CAG(store, canonical=models["gemma"])
    prepared = cag.prepare("What is the capital of France?", mode="native", document_ids=[doc])
    got = answer_logprob(prepared, "Paris")
    fmt = PromptFormat.for_model(loaded)
    prompt = fmt.context_prefix_ids() + fmt.chunk_ids(CONTEXTS[1]) + fmt.separator_ids()
    prompt += fmt.question_suffix_ids("What is the capital of France?")
    assert prompt[: prepared.next_position] + prepared.prompt_ids == prompt
    gold = answer_ids(loaded.tokenizer, prompt, "Paris")
    assert loaded.tokenizer.decode(gold) == " Paris"  # base layout: after "Answer:" comes a space
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([prompt + gold])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    expected = float(logp.gather(1, torch.tensor(gold)[:, None]).mean())
    assert got == pytest.approx(expected, abs=1e-4)
    # the prepared cache is left untouched for generate()
    assert prepared.cache.get_seq_length() == prepared.next_position
    store.close()


class CountingEngine(CAG):
    """A CAG that counts generate calls and can fail after a given number (an interruption)."""

    calls = 0
    fail_after: int | None = None

    def generate(self, prepared, max_new_tokens=64):
        type(self).calls += 1
        if self.fail_after is not None and type(self).calls > self.fail_after:
            raise KeyboardInterrupt
        return super().generate(prepared, max_new_tokens)


def test_resume_after_interruption_gives_the_same_results(dataset, models, tmp_path):
    full = run_eval(config(dataset, models, tmp_path / "a"), progress=False)
    cfg = config(dataset, models, tmp_path / "b")

    def engine(fail_after):
        def make(store):
            CountingEngine.calls, CountingEngine.fail_after = 0, fail_after
            return CountingEngine(store, canonical=cfg.canonical, dtype=cfg.dtype)
        return make

    n_modes = len(cfg.modes)
    # warm-up answers once per mode, then 7 rows are written before the interruption
    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, progress=False, engine_factory=engine(n_modes + 7))
    partial = tmp_path / "b" / "out" / "results.json.partial.jsonl"
    lines = partial.read_text().splitlines()
    assert json.loads(lines[0])["header"] == cfg.header() and len(lines) == 1 + 7
    with partial.open("a") as handle:  # a line torn by the interruption is recomputed
        handle.write('{"kind": "qa", "id": "q')
    resumed = run_eval(cfg, progress=False, engine_factory=engine(None))
    assert CountingEngine.calls == n_modes + len(QUESTIONS) * n_modes - 7
    assert quality(resumed) == quality(full)
    assert resumed["recovery"] == full["recovery"]
    # a finished results file is resumed from too: nothing left to compute
    again = run_eval(cfg, progress=False, engine_factory=engine(0))
    assert quality(again) == quality(full)


def test_larger_limit_and_extra_mode_reuse_earlier_rows(dataset, models, tmp_path):
    small = run_eval(config(dataset, models, tmp_path, limit=2, modes=["none", "native"]), progress=False)
    assert small["n"] == 2 and small["recovery"] == {}
    CountingEngine.calls, CountingEngine.fail_after = 0, None
    cfg = config(dataset, models, tmp_path, limit=3, modes=["none", "native", "canonical"])
    big = run_eval(cfg, progress=False,
                   engine_factory=lambda s: CountingEngine(s, canonical=cfg.canonical, dtype="float32"))
    # 3 warm-up answers + 1 new example x 3 modes + 2 old examples x 1 new mode
    assert CountingEngine.calls == 3 + 3 + 2
    assert big["n"] == 3
    assert quality(small).items() <= quality(big).items()


def test_a_resumed_run_keeps_finished_rows_of_a_translator_that_is_gone(dataset, models, tmp_path):
    kw = dict(target=models["gemma"], limit=2)
    run_eval(config(dataset, models, tmp_path, modes=["none", "native"], **kw), progress=False)
    # finished rows of a translated variant whose folder has since been deleted (copied
    # from the none rows), and the native rows still to compute
    out = tmp_path / "out" / "results.json"
    report = json.loads(out.read_text())
    report["examples"] = [r for r in report["examples"] if r["mode"] == "none"]
    report["examples"] += [{**r, "mode": "old"} for r in report["examples"]]
    out.write_text(json.dumps(report))
    CountingEngine.calls, CountingEngine.fail_after = 0, None
    cfg = config(dataset, models, tmp_path, modes=["none", "native", f"old={tmp_path / 'gone'}@0"], **kw)
    more = run_eval(cfg, progress=False,
                    engine_factory=lambda s: CountingEngine(s, canonical=cfg.canonical, dtype="float32"))
    # only native has rows left: 1 warm-up answer + 2 rows; the variant is never loaded,
    # so its missing card is not an error
    assert CountingEngine.calls == 1 + 2
    assert more["n"] == 2 and more["modes"]["old"] == more["modes"]["none"]


def test_longer_contexts_extend_a_run_made_with_max_context_chars(dataset, models, tmp_path):
    shortest = min(len(c) for c in CONTEXTS)
    short = run_eval(config(dataset, models, tmp_path, modes=["none", "native"],
                            max_context_chars=shortest), progress=False)
    assert 0 < short["n"] < len(QUESTIONS)
    CountingEngine.calls, CountingEngine.fail_after = 0, None
    cfg = config(dataset, models, tmp_path, modes=["none", "native"])
    full = run_eval(cfg, progress=False,
                    engine_factory=lambda s: CountingEngine(s, canonical=cfg.canonical, dtype="float32"))
    # 2 warm-up answers + only the examples the short run left out, in both modes
    assert CountingEngine.calls == 2 + (len(QUESTIONS) - short["n"]) * 2
    assert full["n"] == len(QUESTIONS)
    assert quality(short).items() <= quality(full).items()


def test_shards_split_the_questions_and_a_plain_run_collects_them(dataset, models, tmp_path):
    full = run_eval(config(dataset, models, tmp_path / "a"), progress=False)
    out = tmp_path / "b" / "out" / "results.json"

    def run(**kw):
        cfg = config(dataset, models, tmp_path / "b", **kw)
        CountingEngine.calls, CountingEngine.fail_after = 0, None
        report = run_eval(cfg, progress=False,
                          engine_factory=lambda s: CountingEngine(s, canonical=cfg.canonical, dtype="float32"))
        return report, CountingEngine.calls

    n_modes = 3
    first, calls = run(shard=(1, 2))  # questions 1, 3, 5 of the sample
    assert first["n"] == 3 and calls == n_modes + 3 * n_modes
    assert not out.exists()  # a shard writes no report
    assert (out.parent / "results.json.shard1of2.partial.jsonl").is_file()
    # a shard skips rows another shard's file holds: 1/1 is every question, but only the
    # other two are left to answer
    every, calls = run(shard=(1, 1))
    assert every["n"] == len(QUESTIONS) and calls == n_modes + 2 * n_modes
    collected, calls = run()
    assert calls == 0 and collected["n"] == len(QUESTIONS)
    assert quality(collected) == quality(full)
    assert collected["recovery"] == full["recovery"]
    # in the sample's order, as the plain run reports them, not in the shards' order
    assert [(e["id"], e["mode"]) for e in collected["examples"]] == [(e["id"], e["mode"]) for e in full["examples"]]
    assert out.is_file() and not list(out.parent.glob("*.partial.jsonl"))
    # a shard after the report: nothing left to answer, and the finished rows are read from
    # the results file, not copied into the shard's own
    again, calls = run(shard=(1, 2))
    assert calls == 0 and again["n"] == 3
    assert len((out.parent / "results.json.shard1of2.partial.jsonl").read_text().splitlines()) == 1


def test_bad_shards_are_refused(dataset, models, tmp_path):
    from cagkv.eval.runner import parse_shard

    for shard in [(0, 2), (3, 2)]:
        with pytest.raises(UsageError, match="1 <= K <= N"):
            config(dataset, models, tmp_path, shard=shard)
    with pytest.raises(UsageError, match="needs --out"):
        config(dataset, models, tmp_path, shard=(1, 2), out=None)
    with pytest.raises(UsageError, match="K/N"):
        parse_shard("first")
    assert parse_shard("2/3") == (2, 3)


def test_other_settings_refuse_to_resume(tmp_path):
    path = tmp_path / "r.partial.jsonl"
    PartialResults.open(path, {"seed": 0})
    with pytest.raises(UsageError, match="other settings"):
        PartialResults.open(path, {"seed": 1})


def test_device_is_resolved_checked_and_kept_out_of_cpu_headers(dataset, models, tmp_path, monkeypatch):
    cpu = config(dataset, models, tmp_path)
    assert cpu.device == "cpu" and "device" not in cpu.header()  # earlier result files still resume
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert config(dataset, models, tmp_path, device="auto").header() == cpu.header()
    with pytest.raises(UsageError, match="no CUDA GPU"):
        config(dataset, models, tmp_path, device="cuda")
    with pytest.raises(UsageError, match="unknown device"):
        config(dataset, models, tmp_path, device="gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert config(dataset, models, tmp_path, device="cuda").header()["device"] == "cuda"


class PrefillTranslator:
    """A perfect 'translator': the target's own prefill of the block's text."""

    def good_enough(self):
        return True, "test"

    def translate(self, block, target):
        return prefill_chunks(target, [block.text])[0]


def test_cross_model_translate_open_retrieval_and_kl_text(dataset, models, tmp_path):
    text = tmp_path / "heldout.txt"
    text.write_text(KL_TEXT, encoding="utf-8")
    cfg = config(dataset, models, tmp_path, target=models["gemma"], modes=["none", "native", "translate"],
                 retrieval="open", top_k=1, kl_text=str(text), kl_windows=2, kl_context_tokens=24,
                 kl_continuation_tokens=8)
    report = run_eval(cfg, progress=False, engine_factory=lambda s: CAG(
        s, canonical=cfg.canonical, find_translator=lambda a, b: PrefillTranslator()))
    rows = {(r["id"], r["mode"]): r for r in report["examples"]}
    assert all(r["retrieval_hit"] in (True, False) for (i, m), r in rows.items() if m != "none")
    # a perfect translator reproduces native prefill for single-chunk contexts
    for (qid, mode), row in rows.items():
        if mode == "translate" and rows[(qid, "native")]["sources"] == row["sources"]:
            assert row["answer_logprob"] == pytest.approx(rows[(qid, "native")]["answer_logprob"], abs=2e-3)
    kl = report["modes"]
    assert kl["native"]["kl"] == 0.0 and kl["translate"]["kl"] == pytest.approx(0.0, abs=1e-3)
    assert kl["none"]["kl"] > 1e-3
    assert report["recovery"]["translate"]["kl"] == pytest.approx(1.0, abs=0.01)
    assert len(report["kl_rows"]) == 2 * 3
    assert not math.isnan(report["modes"]["none"]["f1"])


def test_cli_eval(dataset, models, tmp_path):
    from cagkv.cli.app import app

    out = tmp_path / "cli.json"
    result = CliRunner().invoke(app, [
        "eval", "--dataset", str(dataset), "--limit", "2", "--canonical", models["llama"],
        "--modes", "none,native", "--max-new-tokens", "3", "--embedder", "hash-64",
        "--out", str(out), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["n"] == 2 and set(saved["modes"]) == {"none", "native"}
    assert "| native |" in result.output
    bad = CliRunner().invoke(app, ["eval", "--dataset", str(dataset), "--retrieval", "magic"])
    assert bad.exit_code != 0


def test_named_translator_variant_runs_translate_with_that_artifact(dataset, models, tmp_path, monkeypatch):
    import cagkv.translate

    loads = []

    def fake_load(path, source_fp, target_fp):
        loads.append(path)
        return PrefillTranslator()

    monkeypatch.setattr(cagkv.translate, "load_translator", fake_load)
    cfg = config(dataset, models, tmp_path, target=models["gemma"], limit=2,
                 modes=["none", "native", "linear=/artifacts/linear"])
    assert cfg.modes == ["none", "native", "linear"] and cfg.variants == {"linear": "/artifacts/linear"}
    report = run_eval(cfg, progress=False)
    assert loads == ["/artifacts/linear"]  # loaded once for the whole run
    rows = {(r["id"], r["mode"]): r for r in report["examples"]}
    for (qid, mode), row in rows.items():
        if mode == "linear":
            assert row["resolved_mode"] == "translate" and row["translator"] == "/artifacts/linear"
            assert row["answer_logprob"] == pytest.approx(rows[(qid, "native")]["answer_logprob"], abs=2e-3)
    assert set(report["recovery"]) == {"linear"}
    with pytest.raises(UsageError, match=r"NAME=\[TRANSLATOR_DIR\]"):
        config(dataset, models, tmp_path, modes=["none", "=x"])


def test_variant_spec_names_artifact_replay_window_refresh_or_a_bias():
    from cagkv.eval.runner import variant_spec

    assert variant_spec("/a/b") == ("/a/b", None, False, 0.0, None, False, None, None)
    assert variant_spec("/a/b@4") == ("/a/b", 4, False, 0.0, None, False, None, None)
    assert variant_spec("@6") == ("", 6, False, 0.0, None, False, None, None)
    assert variant_spec("/a@b/c@window") == ("/a@b/c", None, True, 0.0, None, False, None, None)
    assert variant_spec("/a/b@refresh0.33") == ("/a/b", 0, False, 0.33, None, False, None, None)  # the card's scoring, else contrast
    assert variant_spec("/a/b@refresh0.33:attention") == ("/a/b", 0, False, 0.33, "attention", False, None, None)
    assert variant_spec("/a/b@refresh0.1:contrast") == ("/a/b", 0, False, 0.1, "contrast", False, None, None)
    assert variant_spec("/a/b@refresh0.2:adaptive+shift") == ("/a/b", 0, False, 0.2, "adaptive", True, None, None)
    assert variant_spec("/a/b@refresh0.2+shift") == ("/a/b", 0, False, 0.2, None, True, None, None)
    assert variant_spec("/a/b@0+bias0.5") == ("/a/b", 0, False, 0.0, None, False, 0.5, None)
    assert variant_spec("/a/b@refresh0.2:contrast+bias-0.25") == ("/a/b", 0, False, 0.2, "contrast", False, -0.25, None)
    assert variant_spec("/a/b@refresh0.2+bias0+shift") == ("/a/b", 0, False, 0.2, None, True, 0.0, None)
    assert variant_spec("/a/b@0+qbias1.5") == ("/a/b", 0, False, 0.0, None, False, 1.5, "question")
    assert variant_spec("/a/b@0+bias-0.25+answer4") == ("/a/b", 0, False, 0.0, None, False, -0.25, "answer4")
    assert variant_spec("/a/b@0+answer0").bias_scope == "answer0"  # the card's bias, scoped
    assert variant_spec("/a/b@0+bias-0.25+sliding").bias_scope == "all,sliding"
    assert variant_spec("/a/b@0+full+answer2").bias_scope == "answer2,full"
    assert variant_spec("/a/b@0+qbias1+full").bias_scope == "question,full"
    assert variant_spec("/a/b@0+qbias-0.25+rest:full").bias_scope == "question,rest:full"
    assert variant_spec("/a/b@0+bias-1+hard0.33").bias_scope == "all,hard0.33"
    assert variant_spec("/a/b@0+qbias1+hard0.5").bias_scope == "question,hard0.5"
    assert variant_spec("/a/b@0+bias-0.25+answer2+rest:sliding").bias_scope == "answer2,rest:sliding"
    assert variant_spec("/a/b@0+bias1+fitted").bias_scope == "all,fitted"
    assert variant_spec("/a/b@0+bias0.5+answer4+fitted").bias_scope == "answer4,fitted"
    for bad in ("/a@0+bias1+answer", "/a@0+bias1+answer-1", "/a@0+bias1+slide", "/a@0+bias1+rest:full", "/a@0+rest:full", "/a@0+bias1+hard2", "/a@0+bias1+answerx", "/a@0+bias1+fit", "/a@0+qbias1+answer2", "/a@0+qbias", "/a@refresh0.2+loud", "/a@2+shift", "/a@window+bias0.5", "/a@0+bias", "/a@0+biasx", "/a@0+biasnan", "/a@x", "@-1", "/a@refresh", "/a@refresh1.5", "/a@refresh0", "/a@refresh0.3:loud", "/a@refresh:contrast"):
        with pytest.raises(UsageError, match="--modes"):
            variant_spec(bad)


def test_the_report_names_the_commit_the_run_started_at(dataset, models, tmp_path, monkeypatch):
    import cagkv.eval.runner as runner

    head = ["aaaa111"]
    real_evaluate = runner.evaluate_example

    def evaluate_then_commit(*args, **kwargs):
        row = real_evaluate(*args, **kwargs)
        head[0] = "bbbb222"  # someone commits while the run goes on
        return row

    monkeypatch.setattr(runner, "git_commit", lambda: head[0])
    monkeypatch.setattr(runner, "evaluate_example", evaluate_then_commit)
    report = run_eval(config(dataset, models, tmp_path, limit=1, modes=["none"]), progress=False)
    assert report["config"]["commit"] == "aaaa111"
