"""The fit scripts' shared set-up (`cagkv.eval.fitting`) on a real shipped translator."""

from __future__ import annotations

import json

import pytest

from cagkv.eval.fitting import copy_translator, fit_bench
from cagkv.translate import find_translator, load_translator
from cagkv.translate.artifact import add_card_record
from cagkv.translate.kv_bias import KV_BIAS_FILE, fit_kv_bias

pytestmark = pytest.mark.integration

DOCS = ["Marie Curie was born in Warsaw in 1867. She moved to Paris in 1891 to study physics at the Sorbonne.",
        "The Great Barrier Reef lies off the coast of Queensland. It is the largest coral reef system in the world."]


def test_kv_bias_fit_through_the_shared_bench(tmp_path, real_model) -> None:
    src, tgt = real_model("smollm2-135m"), real_model("gemma3-270m")
    shipped = find_translator(src.fingerprint, tgt.fingerprint)
    if shipped is None:
        pytest.skip("no smollm2-135m -> gemma3-270m translator installed")
    out = copy_translator(shipped.path, tmp_path / "copy", drop=KV_BIAS_FILE)
    assert not (out / KV_BIAS_FILE).exists()  # measured on the folder's own translation
    translator = load_translator(out)
    with fit_bench(translator, "docs.jsonl", DOCS, prefix="t", progress=False) as bench:
        assert (bench.canonical, bench.target) == ("smollm2-135m", "gemma3-270m")
        assert len(bench.documents) == len(DOCS)
        bias = fit_kv_bias(bench.engine, bench.target, bench.documents)
    spec = tgt.spec
    assert tuple(bias["keys"].shape) == (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    assert int(bias["tokens"]) > 20  # both documents
    card = add_card_record(out, "kv_bias", {"contexts": len(DOCS)})
    assert json.loads((out / "card.json").read_text())["kv_bias"] == {"contexts": 2} == card["kv_bias"]
    assert card["source"] == shipped.card["source"]
