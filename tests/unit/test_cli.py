"""The store commands through typer's test runner: success paths, JSON keys, exit codes,
and every bad input of the issue, each leaving the store unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cagkv.cli.app import app
from cagkv.errors import UsageError
from engine_helpers import make_model_dir, offline_home
from typer.testing import CliRunner

DOC = "The lighthouse keeper lived on the island for thirty years. He lit the lamp at sunset."


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_home")
    with offline_home(root) as env:
        env["other"] = str(make_model_dir(root / "m", "qwen2", chat=True))
        yield env


@pytest.fixture
def store(env, tmp_path):
    """A store holding one document."""
    doc = tmp_path / "keeper.txt"
    doc.write_text(DOC)
    out = run("ingest", str(doc), "--store", str(tmp_path / "store"), "--canonical", env["model"], "--dtype", "float32")
    assert out.exit_code == 0, out.output
    return tmp_path / "store"


def run(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def snapshot(store: Path) -> tuple:
    """Everything a command could change: catalog rows (via stats) and the files."""
    files = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() and "lock" not in p.name and not p.name.endswith(("-wal", "-shm")))
    stats = json.loads(run("stats", "--store", str(store), "--json").stdout)
    return files, stats["documents"], stats["chunks"], stats["generation"]


# ---------------------------------------------------------------------- success paths
def test_ingest_json_summary_and_idempotence(env, tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.md").write_text("# Title\n\nParis is the capital of France. The Seine flows through it.")
    (folder / "sub" / "b.html").write_text("<html><body><p>Ships pass the <b>light</b>.</p><script>x=1</script></body></html>")
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    args = ("ingest", str(folder), "--store", str(tmp_path / "s"), "--canonical", env["model"], "--json")
    out = run(*args)
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert summary["documents"] == 2 and summary["chunks"] == 2 and summary["tokens"] > 10
    assert summary["bytes"] > 0 and summary["tokens_per_s"] > 0
    again = json.loads(run(*args).stdout)
    assert again["documents"] == 0 and again["skipped"] == 2
    # the HTML reader kept the visible text only
    ls = json.loads(run("ls", "--store", str(tmp_path / "s"), "--json").stdout)["documents"]
    assert sorted(Path(d["source"]).name for d in ls) == ["a.md", "b.html"]


def test_ask_json_has_exactly_the_specified_keys(env, store):
    out = run("ask", "How long did the keeper live there?", "--store", str(store), "--json", "--max-new-tokens", "5")
    assert out.exit_code == 0, out.output
    obj = json.loads(out.stdout)
    assert set(obj) == {"answer", "target", "mode", "sources", "timings_ms"}
    assert obj["mode"] == "canonical"
    assert [set(s) for s in obj["sources"]] == [{"document", "chunk", "score"}]
    assert set(obj["timings_ms"]) == {"retrieve", "load", "translate", "replay", "prefill", "first_token", "total"}


def test_ask_modes_and_stream(env, store):
    plain = run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "native", "--max-new-tokens", "6")
    assert plain.exit_code == 0, plain.output
    assert "mode native" in plain.stdout and "timings ms:" in plain.stdout
    streamed = run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "native", "--max-new-tokens", "6",
                   "--stream")  # fmt: skip
    assert streamed.exit_code == 0 and streamed.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    other = run("ask", "Who lit the lamp?", "--store", str(store), "--target", env["other"], "--json",
                "--max-new-tokens", "3")  # fmt: skip
    assert other.exit_code == 0, other.output
    assert json.loads(other.stdout)["mode"] == "native"  # auto, no translator: falls back
    refresh = run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "native", "--refresh", "0.3")
    assert refresh.exit_code == 2 and "refresh needs mode translate" in refresh.output
    scoring = run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "translate", "--refresh", "0.3",
                  "--refresh-scoring", "loud")  # fmt: skip
    assert scoring.exit_code == 2 and "refresh_scoring" in scoring.output
    bias = run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "native", "--attention-bias", "1")
    assert bias.exit_code == 2 and "attention_bias acts on translated tokens" in bias.output
    scope = run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "native", "--attention-bias-scope", "answer")
    assert scope.exit_code == 2 and "attention_bias_scope" in scope.output


def test_ls_stats_rm_doctor(env, store):
    docs = json.loads(run("ls", "--store", str(store), "--json").stdout)["documents"]
    assert len(docs) == 1
    stats = json.loads(run("stats", "--store", str(store), "--json").stdout)
    assert stats["documents"] == 1 and stats["canonical"] == env["model"]
    assert run("doctor", "--store", str(store)).exit_code == 0
    out = run("rm", str(docs[0]["id"]), "--store", str(store))
    assert out.exit_code == 0 and "removed document" in out.stdout
    stats = json.loads(run("stats", "--store", str(store), "--json").stdout)
    assert stats["documents"] == 0 and stats["chunks"] == 0
    assert not [p for p in (store / "blobs").rglob("*.kv")]  # blobs gone too
    assert run("rm", "1", "--store", str(store)).exit_code == 2  # already removed
    # a corrupt blob: doctor finds it (exit 1) and --repair fixes it (exit 0)
    doc = store.parent / "keeper.txt"
    assert run("ingest", str(doc), "--store", str(store), "--dtype", "float32").exit_code == 0
    blob = next((store / "blobs").rglob("*.kv"))
    blob.write_bytes(blob.read_bytes()[:-7] + b"garbage")
    assert run("doctor", "--store", str(store)).exit_code == 1
    assert run("doctor", "--repair", "--store", str(store)).exit_code == 0
    assert run("doctor", "--store", str(store)).exit_code == 0


def test_rm_by_source_path(env, store):
    out = run("rm", str(store.parent / "keeper.txt"), "--store", str(store))
    assert out.exit_code == 0, out.output


# ---------------------------------------------------------------------- bad input
def bad_files(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n ")
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"GIF89a\x00\x00\x01\x02")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    big = tmp_path / "big.txt"
    big.write_text("word " * 400)
    return {
        "missing": ([str(tmp_path / "nope.txt")], "no such file"),
        "empty": ([str(empty)], "empty document"),
        "binary": ([str(binary)], "binary"),
        "non-utf8": ([str(latin)], "not UTF-8"),
        "too-big": ([str(big), "--max-bytes", "1000"], "too large"),
        "empty-folder": ([str(tmp_path / "emptydir")], "no .txt"),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "non-utf8", "too-big", "empty-folder"])
def test_bad_inputs_exit_2_and_leave_the_store_unchanged(env, store, tmp_path, case):
    (tmp_path / "emptydir").mkdir(exist_ok=True)
    args, message = bad_files(tmp_path)[case]
    good = tmp_path / "good.txt"
    good.write_text("A good document that must not be ingested either.")
    before = snapshot(store)
    out = run("ingest", str(good), *args, "--store", str(store))
    assert out.exit_code == 2, out.output
    assert message in out.stderr and out.stderr.count("\n") == 1  # one line, no traceback
    assert snapshot(store) == before


def test_unknown_model_names(env, store, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    out = run("ingest", str(doc), "--store", str(tmp_path / "fresh"), "--canonical", "no-such-model-xyz")
    assert out.exit_code == 2 and "no-such-model-xyz" in out.stderr, out.output
    assert not (tmp_path / "fresh").exists()  # nothing created
    before = snapshot(store)
    out = run("ask", "Who?", "--store", str(store), "--target", "no-such-model-xyz")
    assert out.exit_code == 2 and "no-such-model-xyz" in out.stderr
    assert snapshot(store) == before


def test_unwritable_store(env, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Some text.")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the store folder should go")
    out = run("ingest", str(doc), "--store", str(blocker / "store"), "--canonical", env["model"])
    assert out.exit_code == 1 and "store" in out.stderr and out.stderr.count("\n") == 1, out.output
    if os.geteuid() != 0:  # root writes anywhere; the check above covers it
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        out = run("ingest", str(doc), "--store", str(ro / "s"), "--canonical", env["model"])
        assert out.exit_code == 1


@pytest.mark.parametrize("question", ["", "   "])
def test_empty_question(env, store, question):
    before = snapshot(store)
    out = run("ask", question, "--store", str(store))
    assert out.exit_code == 2 and "empty question" in out.stderr
    assert snapshot(store) == before


def test_store_made_with_another_canonical_model(env, store, tmp_path):
    doc = tmp_path / "other.txt"
    doc.write_text("Another document.")
    before = snapshot(store)
    out = run("ingest", str(doc), "--store", str(store), "--canonical", env["other"])
    assert out.exit_code == 1 and "canonical" in out.stderr
    assert snapshot(store) == before


def test_usage_errors_of_the_commands(env, store, tmp_path):
    assert run("ask", "q", "--store", str(store), "--mode", "fast").exit_code == 2
    assert run("ask", "q", "--store", str(store), "--top-k", "0").exit_code == 2
    bad_device = run("ask", "q", "--store", str(store), "--device", "tpu")
    assert bad_device.exit_code == 2 and "unknown device" in bad_device.stderr
    bad_ingest_device = run("ingest", str(tmp_path / "none.txt"), "--store", str(tmp_path / "s2"), "--device", "tpu")
    assert bad_ingest_device.exit_code == 2 and "unknown device" in bad_ingest_device.stderr
    assert run("ask", "q", "--store", str(store), "--mode", "canonical", "--target", env["other"]).exit_code == 2
    assert run("ingest", "--store", str(store)).exit_code == 2  # no path
    missing = run("ask", "q", "--store", str(tmp_path / "no-store"))
    assert missing.exit_code == 1 and "cagkv ingest" in missing.stderr
    assert not (tmp_path / "no-store").exists()
    assert run("ls", "--store", str(tmp_path / "no-store")).exit_code == 1


def test_stdin(env, tmp_path):
    out = run("ingest", "-", "--store", str(tmp_path / "s"), "--canonical", env["model"], "--json",
              input="Text from a pipe. It has two sentences.")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["documents"] == 1
    empty = run("ingest", "-", "--store", str(tmp_path / "s"), input="")
    assert empty.exit_code == 2 and "empty" in empty.stderr


@pytest.mark.parametrize("argv", [["ingest"], ["ask"], ["no-such-command"], ["ask", "q", "--top-k", "x"]])
def test_entry_point_usage_errors_exit_2(argv, monkeypatch, capsys):
    """The installed `cagkv` script (not CliRunner) turns click usage errors into exit 2."""
    from cagkv.cli.app import main

    monkeypatch.setattr("sys.argv", ["cagkv", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert "Error" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--init", "no-such-folder"], "--init must be random, ridge or a translator folder"),
    (["--train-only", "everything"], "--train-only must be one of"),
    (["--init", "ridge", "--skip-rank", "0"], "--init ridge needs --skip-rank >= 1"),
])
def test_train_rejects_bad_start_options(tmp_path, args, message):
    out = run("train", "--canonical", "a", "--target", "b", "--out", str(tmp_path / "t"), *args)
    assert isinstance(out.exception, UsageError), out.output  # the `cagkv` script exits 2 on it (main())
    assert message in str(out.exception)
    assert not (tmp_path / "t").exists()  # refused before any work


def test_train_init_folder_needs_the_staged_method(tmp_path):
    start = tmp_path / "start"
    start.mkdir()
    (start / "card.json").write_text("{}")
    out = run("train", "--canonical", "a", "--target", "b", "--init", str(start), "--method", "ridge")
    assert isinstance(out.exception, UsageError) and "--method staged" in str(out.exception), out.output
