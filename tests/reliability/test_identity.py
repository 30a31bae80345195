"""Identity of stored caches (issue 8, item 6) through `cagkv ingest` / `cagkv ask`.

The store records the canonical tokenizer's hash (the model fingerprint does not cover
the tokenizer), and each document the chunking parameters its chunks were made with: a
tokenizer changed under the same model is refused, a re-ingest with other chunking
parameters re-chunks, one with the same parameters is a no-op. Tiny random models.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from cagkv.cli.app import app
from engine_helpers import offline_home

from cagkv.ingest import chunking_params
from cagkv.models import load, tokenizer_hash, unload
from cagkv.stores import CacheStore

DOC = "The lighthouse keeper lived on the island for thirty years. He lit the lamp at sunset."


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with offline_home(tmp_path_factory.mktemp("identity_home")) as env:
        yield env


@pytest.fixture
def model(env, tmp_path) -> Path:
    """A private copy of the tiny model: this test may edit its tokenizer."""
    copy = tmp_path / "model"
    shutil.copytree(env["model"], copy)
    yield copy
    unload(str(copy))


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def ingest(doc: Path, store: Path, model: Path, *extra: str) -> dict:
    out = run("ingest", str(doc), "--store", str(store), "--canonical", str(model), "--dtype", "float32", "--json", *extra)
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def ls(store: Path) -> list[dict]:
    out = run("ls", "--store", str(store), "--json")
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)["documents"]


def swap_two_token_ids(model: Path) -> None:
    """Edit tokenizer.json in place: same vocabulary and merges, two ids exchanged."""
    path = model / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = (tok for tok, i in vocab.items() if i in (40, 41))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    unload(str(model))  # the process-wide model cache would hand back the old tokenizer


def test_changed_tokenizer_is_refused_by_ingest_and_ask(model, tmp_path):
    doc, store = tmp_path / "keeper.txt", tmp_path / "store"
    doc.write_text(DOC)
    ingest(doc, store, model)
    before = load(str(model))
    recorded = CacheStore.open(store, create=False).stats()["tokenizer_hash"]
    assert recorded == tokenizer_hash(before.tokenizer)
    swap_two_token_ids(model)
    after = load(str(model))
    assert after.fingerprint == before.fingerprint  # the model fingerprint cannot see it
    new = tokenizer_hash(after.tokenizer)
    assert new != recorded
    other = tmp_path / "other.txt"
    other.write_text("Another document about the island.")
    for args in (("ingest", str(other), "--store", str(store), "--canonical", str(model)),
                 ("ask", "Who lit the lamp?", "--store", str(store)),
                 ("ask", "Who lit the lamp?", "--store", str(store), "--mode", "canonical")):  # fmt: skip
        out = run(*args)
        assert out.exit_code == 1, (args, out.output)
        assert out.stderr.count("\n") == 1 and recorded in out.stderr and new in out.stderr, out.stderr
    assert [Path(d["source"]).name for d in ls(store)] == ["keeper.txt"]
    assert run("ask", "Who lit the lamp?", "--store", str(store), "--mode", "native").exit_code == 0


def test_store_without_tokenizer_hash_is_read_and_gets_it_on_the_next_ingest(model, tmp_path):
    """A store from before this change: no tokenizer hash, schema version 1, no chunking."""
    from sqlalchemy import text as sql

    doc, store = tmp_path / "keeper.txt", tmp_path / "store"
    doc.write_text(DOC)
    ingest(doc, store, model)
    with CacheStore.open(store, create=False) as s, s.catalog.write() as sess:
        sess.execute(sql("ALTER TABLE documents DROP COLUMN chunking"))
        sess.execute(sql("DELETE FROM meta WHERE key = 'tokenizer_hash'"))
        s.catalog.set_meta(sess, "schema_version", 1)
    assert [d["chunking"] for d in ls(store)] == [None]
    assert run("ask", "Who lit the lamp?", "--store", str(store), "--max-new-tokens", "2").exit_code == 0
    with CacheStore.open(store, create=False) as s:
        assert s.tokenizer_hash is None and s.get_meta("schema_version") == 1  # readers write nothing
    again = ingest(doc, store, model)
    assert again["documents"] == 1  # its chunking was not recorded: re-chunked once
    with CacheStore.open(store, create=False) as s:
        assert s.tokenizer_hash == tokenizer_hash(load(str(model)).tokenizer)
        assert s.get_meta("schema_version") == 2
    assert ingest(doc, store, model)["skipped"] == 1
    assert [d["chunking"] for d in ls(store)] == [chunking_params(256)]


def test_other_chunk_size_rechunks_and_the_same_is_a_no_op(model, tmp_path):
    doc, store = tmp_path / "keeper.txt", tmp_path / "store"
    doc.write_text(DOC)
    first = ingest(doc, store, model)
    assert first["documents"] == 1 and first["chunks"] == 1
    assert ingest(doc, store, model)["skipped"] == 1
    small = ingest(doc, store, model, "--chunk-tokens", "8")
    assert small["documents"] == 1 and small["skipped"] == 0 and small["chunks"] > 1
    (entry,) = ls(store)
    assert entry["chunks"] == small["chunks"] and entry["chunking"] == {"chunker": "sentences-v1", "chunk_tokens": 8}
    same = ingest(doc, store, model, "--chunk-tokens", "8")
    assert same["documents"] == 0 and same["skipped"] == 1 and same["chunks"] == 0
    assert ingest(doc, store, model)["documents"] == 1  # back to 256: re-chunked again
    assert ls(store)[0]["chunks"] == 1
    with CacheStore.open(store, create=False) as s:
        assert s.doctor().ok


def test_pre_split_chunks_are_keyed_by_their_texts():
    a = chunking_params(256, ["One.", "Two three."])
    assert a == chunking_params(8, ["One.", "Two three."])  # the budget does not apply to them
    assert a != chunking_params(256, ["One. Two", "three."]) and a["chunker"] == "given"
    assert chunking_params(256) != chunking_params(128)
