"""Hostile and bad input beyond the store (issue 8, item 5): what `cagkv ingest` does with
links leaving the folder, FIFOs and devices, and one very long line; malformed JSONL for
`cagkv eval`; translator artifacts with wrong shapes or a tampered card; a store of another
schema version; and a source scan that nothing cagkv reads is unpickled.

Every CLI case runs the real entry point (`cagkv.cli.app.main`, which maps errors to one
stderr line and exit code 2 for usage, 1 otherwise) under an alarm, so a read that blocks
fails the test instead of hanging it.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from cagkv.cli.app import main
from engine_helpers import make_tokenizer, offline_home
from translate_fixtures import tiny_model

from cagkv.chunking import chunk_text
from cagkv.errors import StoreError, TranslatorError

REPO = Path(__file__).resolve().parents[2]
DOC = "The lighthouse keeper lived on the island for thirty years. He lit the lamp at sunset."


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with offline_home(tmp_path_factory.mktemp("bad_input_home")) as env:
        yield env


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging) when the body blocks, e.g. on opening a FIFO."""

    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def cli(capsys, *args: str, seconds: int = 60) -> tuple[int, str, str]:
    """Run `cagkv ARGS` through the console entry point: (exit code, stdout, stderr)."""
    capsys.readouterr()
    saved = sys.argv
    sys.argv = ["cagkv", *args]
    code = 0
    try:
        with deadline(seconds):
            main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = saved
    out = capsys.readouterr()
    return code, out.out, out.err


def ingest(capsys, env, store: Path, *paths: str) -> tuple[int, str, str]:
    return cli(
        capsys,
        "ingest",
        *paths,
        "--store",
        str(store),
        "--canonical",
        env["model"],
        "--dtype",
        "float32",
        "--json",
    )


def sources(capsys, store: Path) -> list[str]:
    code, out, err = cli(capsys, "ls", "--store", str(store), "--json")
    assert code == 0, err
    return sorted(Path(d["source"]).name for d in json.loads(out)["documents"])


def files_of(store: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(p.relative_to(store)), p.stat().st_size)
        for p in store.rglob("*")
        if p.is_file()
        and "lock" not in p.name
        and not p.name.endswith(("-wal", "-shm"))
    )


# ---------------------------------------------------------------------- ingest: links, FIFOs, long lines
def test_links_leaving_the_folder_are_skipped_and_never_read(env, capsys, tmp_path):
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    # Binary: if ingest ever read these, it would stop with "binary file" (exit 2).
    (outside / "secret.txt").write_bytes(b"SECRET\x00\x01")
    (outside / "dir" / "inner.txt").write_bytes(b"SECRET\x00\x02")
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "good.txt").write_text(DOC)
    (folder / "sub" / "also.md").write_text("Paris is the capital of France.")
    (folder / "leak.txt").symlink_to(outside / "secret.txt")
    (folder / "linked").symlink_to(outside / "dir", target_is_directory=True)
    (folder / "sub" / "up.txt").symlink_to(
        Path("..") / ".." / "outside" / "secret.txt"
    )  # relative escape
    (folder / "inside.txt").symlink_to(
        folder / "good.txt"
    )  # a link inside the folder is fine (same file)
    store = tmp_path / "store"
    code, out, err = ingest(capsys, env, store, str(folder))
    assert code == 0, err
    assert json.loads(out)["documents"] == 2
    notices = [line for line in err.splitlines() if "outside" in line]
    assert (
        len(notices) == 2
        and any("leak.txt" in n for n in notices)
        and any("up.txt" in n for n in notices)
    )
    assert sources(capsys, store) == ["also.md", "good.txt"]


def test_folder_with_only_escaping_links_is_refused(env, capsys, tmp_path):
    (tmp_path / "secret.txt").write_text("secret text outside")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "leak.txt").symlink_to(tmp_path / "secret.txt")
    code, _, err = ingest(capsys, env, tmp_path / "store", str(folder))
    assert code == 2 and "no .txt" in err.splitlines()[-1]
    assert not (tmp_path / "store").exists()


def test_fifo_in_a_folder_is_skipped_without_blocking(env, capsys, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "good.txt").write_text(DOC)
    os.mkfifo(
        folder / "pipe.txt"
    )  # no writer: opening it for reading would block forever
    store = tmp_path / "store"
    code, out, err = ingest(capsys, env, store, str(folder))
    assert code == 0, err
    assert json.loads(out)["documents"] == 1
    assert any(
        "pipe.txt" in line and "not a regular file" in line for line in err.splitlines()
    )
    assert sources(capsys, store) == ["good.txt"]


@pytest.mark.parametrize("kind", ["fifo", "device", "link-to-fifo"])
def test_special_file_named_explicitly_is_refused(env, capsys, tmp_path, kind):
    good = tmp_path / "good.txt"
    good.write_text(DOC)
    store = tmp_path / "store"
    code, _, err = ingest(capsys, env, store, str(good))
    assert code == 0, err
    before = files_of(store)
    if kind == "device":
        special = Path("/dev/null")
    else:
        special = tmp_path / "pipe"
        os.mkfifo(special)
        if kind == "link-to-fifo":
            (tmp_path / "link.txt").symlink_to(special)
            special = tmp_path / "link.txt"
    other = tmp_path / "other.txt"
    other.write_text("Another good document that must not be ingested either.")
    code, _, err = ingest(capsys, env, store, str(other), str(special))
    assert code == 2 and err.count("\n") == 1 and "not a regular file" in err, err
    assert files_of(store) == before and sources(capsys, store) == ["good.txt"]


def test_one_very_long_line_is_chunked_within_budget(env, capsys, tmp_path):
    # Worst case for chunking: no sentence boundary and no whitespace at all.
    tok = make_tokenizer()
    line = "lighthousekeeper" * 12_500  # 200 KB, one "word"
    with deadline(120):
        chunks = chunk_text(line, tok, max_tokens=256)
    assert "".join(c.text for c in chunks) == line  # covers it exactly, in order
    assert all(line[c.start : c.end] == c.text for c in chunks)
    assert (
        max(len(tok(c.text, add_special_tokens=False)["input_ids"]) for c in chunks)
        <= 256
    )
    # And end to end through the CLI: a 24 KB line with spaces but no sentence end.
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(["keeper", "lamp", "island", "sunset"] * 1000))
    code, out, err = ingest(
        capsys, env, tmp_path / "store", str(doc), "--chunk-tokens", "512"
    )
    assert code == 0, err
    summary = json.loads(out)
    assert (
        summary["documents"] == 1 and summary["chunks"] >= 4
    )  # ~4000 tokens in 512-token chunks


# ---------------------------------------------------------------------- eval: malformed JSONL
GOOD = {
    "id": "q1",
    "context": DOC,
    "question": "Who lit the lamp?",
    "answers": ["the keeper"],
}


def _line(**changes) -> str:
    obj = {**GOOD, **changes}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


BAD_DATASETS = {
    "bad-json": ([_line(), '{"id": "q2", "context": '], 2, "not valid JSON"),
    "not-an-object": ([_line(), "[1, 2]"], 2, "expected a JSON object"),
    "missing-keys": (
        [_line(), _line(id="q2", answers=...)],
        2,
        "missing keys ['answers']",
    ),
    "answers-not-strings": ([_line(answers=[1, 2])], 1, "'answers' must be"),
    "answers-empty": ([_line(answers=[])], 1, "'answers' must be"),
    "context-not-string": (
        [_line(context={"text": DOC})],
        1,
        "'context' must be a string",
    ),
    "question-not-string": (
        [_line(question=["Who?"])],
        1,
        "'question' must be a string",
    ),
    "id-not-scalar": ([_line(id=None)], 1, "'id' must be"),
    "meta-not-object": ([_line(meta="x")], 1, "'meta' must be a JSON object"),
    "empty-question": ([_line(question="  ")], 1, "empty question"),
    "duplicate-id": ([_line(), "", _line()], 3, "duplicate id"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATASETS))
def test_malformed_jsonl_names_the_line_and_exits_2(env, capsys, tmp_path, case):
    lines, number, message = BAD_DATASETS[case]
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = cli(capsys, "eval", "--dataset", str(path), "--canonical", env["model"], "--no-progress",
                       "--out", str(tmp_path / "r.json"))  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path}:{number}:" in err and message in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "content", [b"", b"\n  \n", b'{"id": "q1", "context": "caf\xe9"}\n']
)
def test_empty_or_non_utf8_dataset_exits_2(env, capsys, tmp_path, content):
    path = tmp_path / "qa.jsonl"
    path.write_bytes(content)
    code, _, err = cli(
        capsys,
        "eval",
        "--dataset",
        str(path),
        "--canonical",
        env["model"],
        "--no-progress",
    )
    assert code == 2 and err.count("\n") == 1, err
    assert (
        ("not UTF-8" in err and f"{path}:1:" in err)
        if content.strip()
        else "no examples" in err
    )


def test_missing_dataset_exits_2(env, capsys, tmp_path):
    code, _, err = cli(
        capsys, "eval", "--dataset", str(tmp_path / "nope.jsonl"), "--no-progress"
    )
    assert code == 2 and "not found" in err and err.count("\n") == 1


# ---------------------------------------------------------------------- translator artifacts
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from cagkv.translate import save_artifact
    from cagkv.translate.mot import MoTTranslator
    from cagkv.translate.train import TrainConfig, make_mot_config

    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    torch.manual_seed(0)
    cfg = make_mot_config(
        src,
        tgt,
        TrainConfig(
            d_model=16, d_expert=24, experts=3, top_k=2, group_size=2, skip_rank=0
        ),
    )
    card = {"source": {"name": "a", "fingerprint": src.fingerprint},
            "target": {"name": "b", "fingerprint": tgt.fingerprint}, "quality": {"value": 0.7}}  # fmt: skip
    folder = save_artifact(
        tmp_path_factory.mktemp("tr") / "a__b", MoTTranslator(cfg), card
    )
    return folder, src.fingerprint, tgt.fingerprint


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _edit_weights(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "weights.safetensors"))
    edit(state)
    save_file(state, str(folder / "weights.safetensors"))


def _edit_card(folder: Path, edit) -> None:
    card = json.loads((folder / "card.json").read_text())
    edit(card)
    (folder / "card.json").write_text(json.dumps(card))


def _first_matrix(state: dict) -> str:
    return next(k for k, v in state.items() if v.dim() == 2)


TAMPER = {
    "weight-wrong-shape": (lambda f: _edit_weights(f, lambda s: s.__setitem__(_first_matrix(s), s[_first_matrix(s)][:, :-1].contiguous())),
                           "do not fit"),
    "weight-missing": (lambda f: _edit_weights(f, lambda s: s.pop(_first_matrix(s))), "missing"),
    "weight-extra": (lambda f: _edit_weights(f, lambda s: s.__setitem__("bogus.weight", torch.zeros(2))), "unexpected"),
    "weight-nan": (lambda f: _edit_weights(f, lambda s: s[_first_matrix(s)].view(-1).__setitem__(0, float("nan"))), "NaN"),
    "weights-truncated": (lambda f: (f / "weights.safetensors").write_bytes((f / "weights.safetensors").read_bytes()[:100]),
                          "unreadable"),
    "weights-not-safetensors": (lambda f: (f / "weights.safetensors").write_bytes(b"\x80\x04pickle?"), "unreadable"),
    "weights-deleted": (lambda f: (f / "weights.safetensors").unlink(), "weights missing"),
    "card-more-experts": (lambda f: _edit_card(f, lambda c: c["config"].__setitem__("experts", c["config"]["experts"] + 1)),
                          "do not fit"),
    "card-wider-model": (lambda f: _edit_card(f, lambda c: c["config"].__setitem__("d_model", c["config"]["d_model"] * 2)),
                         "do not fit"),
    "card-unknown-key": (lambda f: _edit_card(f, lambda c: c["config"].__setitem__("bogus", 1)), "bad config"),
    "card-no-config": (lambda f: _edit_card(f, lambda c: c.pop("config")), "bad config"),
    "card-bad-json": (lambda f: (f / "card.json").write_text('{"format": '), "not valid JSON"),
    "card-other-version": (lambda f: _edit_card(f, lambda c: c.__setitem__("version", 99)), "version 99"),
    "card-other-format": (lambda f: _edit_card(f, lambda c: c.__setitem__("format", "x")), "not a cagkv translator"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampered_translator_artifact_is_refused_in_one_line(artifact, tmp_path, case):
    from cagkv.translate import load_translator

    folder, src_fp, tgt_fp = artifact
    copy = _copy(folder, tmp_path / "a__b")
    load_translator(copy, src_fp, tgt_fp)  # the copy loads before tampering
    tamper, message = TAMPER[case]
    tamper(copy)
    with pytest.raises(TranslatorError) as err:
        load_translator(copy, src_fp, tgt_fp)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_translator_for_other_fingerprints_is_refused(artifact, tmp_path, monkeypatch):
    from cagkv.translate import find_translator, load_translator

    folder, src_fp, tgt_fp = artifact
    with pytest.raises(TranslatorError, match="target model"):
        load_translator(folder, src_fp, "0" * 16)
    with pytest.raises(TranslatorError, match="source model"):
        load_translator(folder, "f" * 16, tgt_fp)
    with pytest.raises(TranslatorError, match="source model"):  # swapped direction
        load_translator(folder, tgt_fp, src_fp)
    assert find_translator(src_fp, tgt_fp, [folder.parent]) is not None
    assert find_translator(tgt_fp, src_fp, [folder.parent]) is None
    # A card edited to claim other models: its weights are then not offered for the real pair.
    copy = _copy(folder, tmp_path / "c__d")
    _edit_card(copy, lambda c: c["target"].__setitem__("fingerprint", "0" * 16))
    assert [
        r["path"] for r in _rows(tmp_path) if r["target_fingerprint"] == tgt_fp
    ] == []
    assert find_translator(src_fp, tgt_fp, [tmp_path]) is None


def _rows(base: Path) -> list[dict]:
    from cagkv.translate import list_translators

    return list_translators([base])


# ---------------------------------------------------------------------- store of another schema version
def test_store_of_another_schema_version_is_refused(env, capsys, tmp_path):
    from cagkv.stores import CacheStore

    doc = tmp_path / "keeper.txt"
    doc.write_text(DOC)
    store = tmp_path / "store"
    code, _, err = ingest(capsys, env, store, str(doc))
    assert code == 0, err
    s = CacheStore.open(store)
    with s.catalog.write() as sess:
        s.catalog.set_meta(sess, "schema_version", 999)
    s.close()
    before = files_of(store)
    with pytest.raises(StoreError, match="schema version 999"):
        CacheStore.open(store)
    other = tmp_path / "other.txt"
    other.write_text("Another document.")
    for args in (("ingest", str(other), "--store", str(store), "--canonical", env["model"]),
                 ("ask", "Who lit the lamp?", "--store", str(store)),
                 ("ls", "--store", str(store)),
                 ("doctor", "--store", str(store), "--repair")):  # fmt: skip
        code, _, err = cli(capsys, *args)
        assert code == 1 and err.count("\n") == 1 and "schema version 999" in err, (
            args,
            err,
        )
    assert files_of(store) == before


# ---------------------------------------------------------------------- nothing is unpickled
_SCANNED = ("cagkv", "stores", "cli")


def unpickling_calls(source: str, name: str) -> list[str]:
    """Places in `source` that could unpickle: pickle/dill/joblib/marshal imports and loads,
    `torch.load` without `weights_only=True`, `allow_pickle=True`."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            if any(m.split(".")[0] in {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
                   for m in mods):  # fmt: skip
                found.append(f"{where}: imports {mods}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        dotted = ast.unparse(func)
        kw = {k.arg: k.value for k in node.keywords}
        if dotted.endswith("torch.load"):
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append(f"{where}: torch.load without weights_only=True")
        if dotted.split(".")[0] in {
            "pickle",
            "dill",
            "joblib",
            "marshal",
        } and dotted.split(".")[-1].startswith("load"):
            found.append(f"{where}: {dotted}")
        if "allow_pickle" in kw and not (
            isinstance(kw["allow_pickle"], ast.Constant)
            and kw["allow_pickle"].value is False
        ):
            found.append(f"{where}: allow_pickle")
    return found


def test_the_scanner_finds_unpickling():
    bad = ("import pickle\nimport torch\nimport numpy as np\npickle.loads(b'')\ntorch.load('x')\n"
           "torch.load('x', weights_only=False)\nnp.load('x', allow_pickle=True)\nfrom joblib import load\n")  # fmt: skip
    assert len(unpickling_calls(bad, "bad.py")) == 6
    assert (
        unpickling_calls("import torch\ntorch.load('x', weights_only=True)\n", "ok.py")
        == []
    )


def test_no_code_path_unpickles():
    files = [p for d in _SCANNED for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 20  # the scan really looked at the package
    found = [
        hit
        for p in files
        for hit in unpickling_calls(p.read_text(), str(p.relative_to(REPO)))
    ]
    assert found == []
