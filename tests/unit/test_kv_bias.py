"""A translator's mean K/V error (cagkv.translate.kv_bias): the average it fits, its file, and
the translator adding it to every translation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import CORPUS, chunk_block, saved_translator  # noqa: E402

from cagkv.errors import TranslatorError  # noqa: E402
from cagkv.translate.kv_bias import (  # noqa: E402
    KV_BIAS_FILE,
    BiasAccumulator,
    apply_kv_bias,
    load_kv_bias,
    save_kv_bias,
)


def test_the_accumulator_averages_native_minus_translated_over_every_token() -> None:
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(3, 2, t, 4, generator=g), torch.randn(3, 2, t, 4, generator=g)) for t in (5, 9)]
    acc = BiasAccumulator()
    for native, translated in chunks:
        acc.add(native, translated, 2 * native, translated)
    got = acc.result()
    diff = torch.cat([n - t for n, t in chunks], dim=2)  # every token weighs alike, not every chunk
    torch.testing.assert_close(got["keys"], diff.mean(dim=2))
    torch.testing.assert_close(got["values"], torch.cat([2 * n - t for n, t in chunks], dim=2).mean(dim=2))
    assert int(got["tokens"]) == 14
    with pytest.raises(ValueError, match="one shape"):
        acc.add(torch.zeros(3, 2, 4, 4), torch.zeros(3, 2, 5, 4), torch.zeros(3, 2, 4, 4), torch.zeros(3, 2, 4, 4))
    with pytest.raises(ValueError, match="earlier"):
        acc.add(*[torch.zeros(2, 2, 4, 4)] * 4)
    with pytest.raises(ValueError, match="no tokens"):
        BiasAccumulator().result()


def test_offsets_round_trip_and_bad_files_are_refused(tmp_path: Path) -> None:
    assert load_kv_bias(tmp_path, 3, 2, 4) is None
    bias = {"keys": torch.randn(3, 2, 4), "values": torch.randn(3, 2, 4), "tokens": torch.tensor(7)}
    assert save_kv_bias(bias, tmp_path) == tmp_path / KV_BIAS_FILE
    got = load_kv_bias(tmp_path, 3, 2, 4)
    torch.testing.assert_close(got["keys"], bias["keys"])
    torch.testing.assert_close(got["values"], bias["values"])
    with pytest.raises(TranslatorError, match="shape"):
        load_kv_bias(tmp_path, 4, 2, 4)  # another target's layers
    save_kv_bias({"keys": torch.full((3, 2, 4), float("nan")), "values": torch.zeros(3, 2, 4)}, tmp_path)
    with pytest.raises(TranslatorError, match="finite"):
        load_kv_bias(tmp_path, 3, 2, 4)
    (tmp_path / KV_BIAS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(TranslatorError, match="unreadable"):
        load_kv_bias(tmp_path, 3, 2, 4)
    keys, values = torch.zeros(3, 2, 5, 4), torch.ones(3, 2, 5, 4, dtype=torch.bfloat16)
    k, v = apply_kv_bias(keys, values, bias)
    assert v.dtype == torch.bfloat16
    torch.testing.assert_close(k[:, :, 4], bias["keys"])
    torch.testing.assert_close(v[:, :, 0], (1 + bias["values"]).to(torch.bfloat16))


def test_a_translator_adds_the_offsets_beside_its_weights_to_every_translation(tmp_path: Path) -> None:
    from cagkv.translate.artifact import load_translator

    src, tgt, _, folder = saved_translator(tmp_path / "t")
    block = chunk_block(src, CORPUS[0])
    plain = load_translator(folder)
    assert plain.kv_bias is None
    before = plain.translate(block, tgt)
    spec = tgt.spec
    bias = {"keys": torch.randn(spec.num_layers, spec.num_kv_heads, spec.head_dim),
            "values": torch.randn(spec.num_layers, spec.num_kv_heads, spec.head_dim)}
    save_kv_bias(bias, folder)
    shifted = load_translator(folder)
    after = shifted.translate(block, tgt)
    torch.testing.assert_close(after.keys - before.keys, bias["keys"][:, :, None].expand_as(after.keys))
    torch.testing.assert_close(after.values - before.values, bias["values"][:, :, None].expand_as(after.values))
