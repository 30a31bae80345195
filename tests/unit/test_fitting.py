"""The fit scripts' folder handling (`cagkv.eval.fitting`); the engine set-up is tested on real models."""

from __future__ import annotations

import json

import pytest

from cagkv.eval.fitting import add_card_record, copy_translator


def test_copy_translator_leaves_out_the_table_being_fitted_and_keeps_the_source(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "card.json").write_text(json.dumps({"format": "cagkv.translator"}))
    (src / "weights.safetensors").write_bytes(b"w")
    (src / "kv_bias.safetensors").write_bytes(b"old")
    out = copy_translator(src, tmp_path / "out", drop="kv_bias.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["card.json", "weights.safetensors"]
    assert (src / "kv_bias.safetensors").read_bytes() == b"old"
    card = add_card_record(out, "kv_bias", {"contexts": 3})
    assert card == {"format": "cagkv.translator", "kv_bias": {"contexts": 3}}
    assert json.loads((src / "card.json").read_text()) == {"format": "cagkv.translator"}


def test_copy_translator_refuses_a_folder_without_a_card(tmp_path) -> None:
    with pytest.raises(SystemExit, match="not a translator folder"):
        copy_translator(tmp_path, tmp_path / "out", drop="kv_bias.safetensors")
    assert not (tmp_path / "out").exists()
