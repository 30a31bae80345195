"""The key correction from every source layer (cagkv.translate.key_ridge): the ridge it fits
from running sums, its file, and the translator adding it to every translation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import CORPUS, chunk_block, saved_translator  # noqa: E402

from cagkv.errors import TranslatorError  # noqa: E402
from cagkv.translate.key_ridge import (  # noqa: E402
    KEY_RIDGE_FILE,
    RidgeAccumulator,
    apply_key_ridge,
    fit_key_ridge,
    load_key_ridge,
    ridge_features,
    save_key_ridge,
)


def predict(ridge: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x @ ridge["down"] @ ridge["up"] + ridge["bias"]


def linear_data(n: int = 400, f: int = 6, layers: int = 3, width: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g) * torch.linspace(0.5, 3.0, f) + torch.linspace(-2.0, 2.0, f)
    a = torch.randn(f, layers * width, generator=g)
    y = (x @ a + torch.linspace(1.0, 5.0, layers * width)).reshape(n, layers, width)
    return x, y


def test_a_weak_ridge_recovers_a_linear_map_from_sums_added_in_any_split() -> None:
    x, y = linear_data()
    whole, split = RidgeAccumulator(), RidgeAccumulator()
    whole.add(x, y)
    split.add(x[:150], y[:150])
    split.add(x[150:], y[150:])
    assert whole.n == split.n == 400
    torch.testing.assert_close(split.sxx, whole.sxx, rtol=1e-5, atol=1e-3)  # float32 products
    with_mean = fit_key_ridge(whole, [0, 1, 2], lam=1e-9, with_mean=True)
    torch.testing.assert_close(predict(with_mean, x), y.reshape(400, -1), atol=1e-3, rtol=1e-3)
    # without the mean: the centred error, so that the correction adds nothing on average
    centred = fit_key_ridge(split, [0, 1, 2], lam=1e-9)
    got = predict(centred, x)
    torch.testing.assert_close(got + y.reshape(400, -1).mean(0), y.reshape(400, -1), atol=1e-3, rtol=1e-3)
    assert got.mean(0).abs().max() < 1e-3
    # only the asked layers, in their order
    one = fit_key_ridge(whole, [2], lam=1e-9, with_mean=True)
    torch.testing.assert_close(predict(one, x), y[:, 2], atol=1e-3, rtol=1e-3)
    # a strong ridge shrinks towards the mean
    strong = fit_key_ridge(whole, [0, 1, 2], lam=1e6)
    assert predict(strong, x).abs().max() < 1e-2


def test_rank_keeps_the_top_directions_and_bad_input_is_refused() -> None:
    x, y = linear_data(f=8)
    acc = RidgeAccumulator()
    acc.add(x, y)
    full, low = fit_key_ridge(acc, [0, 1, 2], lam=0.1), fit_key_ridge(acc, [0, 1, 2], lam=0.1, rank=2)
    assert low["down"].shape == (8, 2) and low["up"].shape == (2, 12)
    w = full["down"] @ full["up"]
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    torch.testing.assert_close(low["down"] @ low["up"], (u[:, :2] * s[:2]) @ vh[:2], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="two tokens"):
        fit_key_ridge(RidgeAccumulator(), [0])
    with pytest.raises(ValueError, match="layers must be"):
        fit_key_ridge(acc, [3])
    with pytest.raises(ValueError, match="same tokens"):
        acc.add(x[:5], y[:4])
    with pytest.raises(ValueError, match="earlier"):
        acc.add(x[:5, :7], y[:5])


def test_the_file_round_trips_and_bad_files_are_refused(tmp_path: Path) -> None:
    assert load_key_ridge(tmp_path, 4, 3, 5, 8) is None
    ridge = {"down": torch.randn(2 * 2 * 3, 5), "up": torch.randn(5, 2 * 8), "bias": torch.randn(16),
             "layers": torch.tensor([1, 4])}
    assert save_key_ridge(ridge, tmp_path, [0, 3], dtype=torch.float32) == tmp_path / KEY_RIDGE_FILE
    got = load_key_ridge(tmp_path, 4, 3, 5, 8)
    for name in ("down", "up", "bias"):
        torch.testing.assert_close(got[name], ridge[name])
    save_key_ridge(ridge, tmp_path, [0, 3])  # the factors in float16 by default, read back in float32
    half = load_key_ridge(tmp_path, 4, 3, 5, 8)
    assert half["down"].dtype == torch.float32
    torch.testing.assert_close(half["down"], ridge["down"].half().float())
    torch.testing.assert_close(half["bias"], ridge["bias"])
    assert got["source_layers"].tolist() == [0, 3] and got["layers"].tolist() == [1, 4]
    with pytest.raises(TranslatorError, match="key ridge"):
        load_key_ridge(tmp_path, 3, 3, 5, 8)  # a source with fewer layers
    with pytest.raises(TranslatorError, match="key ridge"):
        load_key_ridge(tmp_path, 4, 3, 5, 16)  # another target's key width
    save_key_ridge({**ridge, "bias": torch.full((16,), float("nan"))}, tmp_path, [0, 3])
    with pytest.raises(TranslatorError, match="finite"):
        load_key_ridge(tmp_path, 4, 3, 5, 8)
    (tmp_path / KEY_RIDGE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(TranslatorError, match="unreadable"):
        load_key_ridge(tmp_path, 4, 3, 5, 8)


def test_apply_adds_the_correction_to_the_fitted_layers_only() -> None:
    keys = torch.zeros(4, 2, 3, 5, dtype=torch.bfloat16)
    ridge = {"down": torch.eye(6), "up": torch.ones(6, 20), "bias": torch.zeros(20), "layers": torch.tensor([1, 3])}
    features = torch.arange(18, dtype=torch.float32).reshape(3, 6)  # token t's features sum to 36 t + 15
    out = apply_key_ridge(keys, features, ridge)
    assert out.dtype == torch.bfloat16
    assert out[[0, 2]].abs().sum() == 0
    for t in range(3):
        assert (out[[1, 3], :, t] == 36 * t + 15).all()
    float_keys = torch.zeros(4, 2, 3, 5)
    apply_key_ridge(float_keys, features, ridge)
    assert float_keys.abs().sum() == 0  # the caller's keys are left as they were


def test_a_translator_adds_the_correction_beside_its_weights_to_every_translation(tmp_path: Path) -> None:
    from cagkv.translate.artifact import load_translator

    src, tgt, mot, folder = saved_translator(tmp_path / "t")
    block = chunk_block(src, CORPUS[0])
    plain = load_translator(folder)
    assert plain.key_ridge is None
    before = plain.translate(block, tgt)
    cfg, layers = mot.cfg, [2, 5]
    g = torch.Generator().manual_seed(1)
    ridge = {"down": torch.randn(3 * 2 * cfg.src_kv_dim, 4, generator=g) * 0.01,
             "up": torch.randn(4, len(layers) * cfg.tgt_kv_heads * cfg.tgt_head_dim, generator=g),
             "bias": torch.zeros(len(layers) * cfg.tgt_kv_heads * cfg.tgt_head_dim), "layers": torch.tensor(layers)}
    save_key_ridge(ridge, folder, [0, 1, 3], dtype=torch.float32)
    after = load_translator(folder).translate(block, tgt)
    features = ridge_features(block.keys, block.values, block.offsets, before.offsets, [0, 1, 3])
    expected = apply_key_ridge(before.keys, features, ridge)
    torch.testing.assert_close(after.keys, expected)
    assert not torch.equal(after.keys[2], before.keys[2])
    torch.testing.assert_close(after.keys[[0, 1, 3, 4]], before.keys[[0, 1, 3, 4]])
    torch.testing.assert_close(after.values, before.values)
