"""The fit scripts' folder handling (`cagkv.eval.fitting`, `artifact.add_card_record`); the engine set-up is tested
on real models."""

from __future__ import annotations

import json

import pytest

from cagkv.errors import TranslatorError
from cagkv.eval.fitting import copy_translator
from cagkv.translate.artifact import add_card_record


def test_copy_translator_leaves_out_the_table_being_fitted_and_keeps_the_source(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    card = {"format": "cagkv.translator", "version": 1}
    (src / "card.json").write_text(json.dumps(card))
    (src / "weights.safetensors").write_bytes(b"w")
    (src / "kv_bias.safetensors").write_bytes(b"old")
    out = copy_translator(src, tmp_path / "out", drop="kv_bias.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["card.json", "weights.safetensors"]
    assert (src / "kv_bias.safetensors").read_bytes() == b"old"
    written = add_card_record(out, "kv_bias", {"contexts": 3})
    assert written == {**card, "kv_bias": {"contexts": 3}} == json.loads((out / "card.json").read_text())
    assert json.loads((src / "card.json").read_text()) == card


def test_copy_translator_refuses_a_folder_without_a_card(tmp_path) -> None:
    with pytest.raises(SystemExit, match="not a translator folder"):
        copy_translator(tmp_path, tmp_path / "out", drop="kv_bias.safetensors")
    assert not (tmp_path / "out").exists()


def test_add_card_record_refuses_a_card_of_another_format(tmp_path) -> None:
    (tmp_path / "card.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(TranslatorError, match="not a cagkv translator card"):
        add_card_record(tmp_path, "kv_bias", {})
    assert "kv_bias" not in json.loads((tmp_path / "card.json").read_text())
