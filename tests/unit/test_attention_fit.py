"""The attention bias fitted to native's attention shares (cagkv.translate.attention_fit, E95)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_lms import tiny

from cagkv.errors import TranslatorError
from cagkv.models.cache import full_cache
from cagkv.models.layers import AttentionBias, decoder_of
from cagkv.refresh import prompt_attention
from cagkv.translate.attention_fit import (ATTENTION_FIT_FILE, Fed, FitCase, chunk_shares, fit_attention_bias,
                                          load_attention_fit, save_attention_fit)

CHUNK = torch.arange(3, 17)


def _cache(model, ids: torch.Tensor):
    with torch.no_grad():
        cache = full_cache()
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _perturbed(cache, seed: int):
    """The same cache with its chunk's keys and values moved (a stand-in for a translation)."""
    out = copy.deepcopy(cache)
    g = torch.Generator().manual_seed(seed)
    for layer in out.layers:
        layer.keys[:, :, CHUNK] += 0.8 * torch.randn(layer.keys[:, :, CHUNK].shape, generator=g)
        layer.values[:, :, CHUNK] += 0.8 * torch.randn(layer.values[:, :, CHUNK].shape, generator=g)
    return out


def _ids(seed: int) -> list[int]:
    return torch.randint(3, 90, (26,), generator=torch.Generator().manual_seed(seed)).tolist()


def _setup(family: str = "qwen2", seed: int = 0):
    lm = tiny(family)
    ids = _ids(seed)
    return lm, _cache(lm.model, torch.tensor([ids[:20]])), ids[20:]


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_the_shares_are_the_prompts_attention_mass_per_layer_and_head(family: str) -> None:
    lm, native, prompt = _setup(family)
    shares = chunk_shares(lm.model, native, 20, prompt, CHUNK)
    layers = len(decoder_of(lm.model).layers)
    assert shares.shape == (layers, lm.config.num_attention_heads)
    assert bool(((shares > 0) & (shares < 1)).all())
    # summed over layers and heads, times the prompt's length: prompt_attention's mass on the chunk
    mass = prompt_attention(lm.model, native, 20, [prompt])[0]
    torch.testing.assert_close(shares.sum() * len(prompt), mass[CHUNK].sum(), atol=1e-4, rtol=1e-4)
    assert native.get_seq_length() == 20  # the cache is not changed


def test_a_bias_moves_the_first_layers_share_by_its_logit() -> None:
    # layer 0's inputs do not depend on any bias: its share s moves to s e^b / (s e^b + 1 - s) exactly
    lm, native, prompt = _setup()
    table = torch.randn(len(decoder_of(lm.model).layers), lm.config.num_attention_heads,
                        generator=torch.Generator().manual_seed(1))
    plain = chunk_shares(lm.model, native, 20, prompt, CHUNK)[0]
    got = chunk_shares(lm.model, native, 20, prompt, CHUNK, AttentionBias(CHUNK, 1.0, per_layer=table))
    # a longer prompt's share is a mean over its tokens, which the formula does not pass through:
    # checked on a one-token prompt, where the mean is the share itself
    one = prompt[:1]
    s = chunk_shares(lm.model, native, 20, one, CHUNK)[0]
    moved = chunk_shares(lm.model, native, 20, one, CHUNK, AttentionBias(CHUNK, 1.0, per_layer=table))[0]
    e = torch.exp(table[0])
    torch.testing.assert_close(moved, s * e / (s * e + 1 - s), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[0], plain, atol=1e-4)


def test_one_round_on_one_question_matches_the_first_layers_share_and_no_gap_fits_no_bias() -> None:
    lm, native, prompt = _setup()
    case = FitCase(lm.model, Fed(native, 20, prompt[:1]), Fed(_perturbed(native, 2), 20, prompt[:1]), CHUNK)
    fit = fit_attention_bias([case], rounds=1)
    torch.testing.assert_close(fit["fitted"][0], fit["native"][0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fit["translated"][0], fit["native"][0], atol=1e-3)
    # more rounds close the gap of the upper layers too
    gap = (fit["fitted"] - fit["native"]).abs().mean()
    three = fit_attention_bias([case], rounds=3)
    assert (three["fitted"] - three["native"]).abs().mean() < gap
    same = fit_attention_bias([FitCase(lm.model, Fed(native, 20, prompt), Fed(copy.deepcopy(native), 20, prompt), CHUNK)],
                              rounds=2)
    assert same["bias"].abs().max() < 1e-4


def test_a_separator_fed_with_the_question_is_left_out_of_the_shares() -> None:
    # native prefill holds the separator (one more cached token), the translation feeds it with
    # the question: the shares are the question's, at the same positions in both
    lm, native, prompt = _setup()
    shorter = _cache(lm.model, torch.tensor([[*_ids(0)[:19]]]))
    case = FitCase(lm.model, Fed(native, 20, prompt), Fed(shorter, 19, [_ids(0)[19], *prompt]), CHUNK)
    assert case.question_tokens == len(prompt)
    torch.testing.assert_close(
        chunk_shares(lm.model, shorter, 19, case.translated.prompt_ids, CHUNK, last=len(prompt)),
        chunk_shares(lm.model, native, 20, prompt, CHUNK), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="same position"):
        FitCase(lm.model, Fed(native, 20, prompt), Fed(shorter, 19, prompt), CHUNK).question_tokens


def test_the_fitted_table_is_saved_beside_the_weights_and_checked_on_load(tmp_path) -> None:
    assert load_attention_fit(tmp_path, 3) is None
    table = torch.randn(3, 4)
    save_attention_fit({"bias": table, "native": torch.rand(3, 4)}, tmp_path)
    torch.testing.assert_close(load_attention_fit(tmp_path, 3), table)
    with pytest.raises(TranslatorError, match="shape"):
        load_attention_fit(tmp_path, 5)
    (tmp_path / ATTENTION_FIT_FILE).write_bytes(b"not safetensors")
    with pytest.raises(TranslatorError, match="unreadable"):
        load_attention_fit(tmp_path, 3)
    with pytest.raises(ValueError, match="no questions"):
        fit_attention_bias([])
