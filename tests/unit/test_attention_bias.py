"""The question-time attention bias on cached positions (`cagkv.models.layers.AttentionBias`, E86)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_lms import tiny
from transformers import DynamicCache

from cagkv.models.cache import full_cache
from cagkv.models.layers import (AttentionBias, BiasScope, decoder_of, forward_at, head_logits, layer_types,
                                 parse_bias_scope, run_layers)
from cagkv.refresh import _mask, feed, refresh_tokens

BIASED = torch.tensor([2, 3, 5, 11, 17, 19])  # some of them outside Gemma-3's tiny window (8) for the fed tokens


def _cache(model, ids: torch.Tensor, factory) -> object:
    with torch.no_grad():
        cache = factory()
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _reference(model, cache, n: int, ids: list[int], bias: AttentionBias) -> torch.Tensor:
    """Logits `[T, V]` built another way: masks from absolute positions (`cagkv.refresh._mask`)
    over a cache that keeps every token, the bias added by position."""
    inner = decoder_of(model)
    types = layer_types(inner.config, len(inner.layers))
    window = getattr(inner.config, "sliding_window", None)
    queries = n + torch.arange(len(ids))
    keys = torch.arange(n + len(ids))
    before = torch.ones(len(ids), dtype=torch.bool) if bias.until is None else queries < bias.until

    def rows(kind: str) -> torch.Tensor:  # which queries read the bias in a layer of this kind
        early = bias.kinds is None or kind in bias.kinds
        return (before & early) | (~before & (kind in bias.rest_kinds))

    def mask(kind: str, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        return (_mask(keys, torch.zeros(len(keys), dtype=torch.bool), queries,
                      window if kind == "sliding_attention" else None, torch.float32)
                + bias.value * torch.as_tensor(scale).reshape(-1, 1, 1)
                * rows(kind).float()[:, None] * torch.isin(keys, bias.positions).float()[None, :])

    masks: dict = {kind: mask(kind) for kind in set(types)}
    if bias.per_layer is not None:  # one mask per layer, each head's bias scaled by its entry
        masks.update({i: mask(kind, bias.per_layer[i]) for i, kind in enumerate(types)})
    with torch.no_grad():
        hidden = run_layers(model, model.get_input_embeddings()(torch.tensor([ids])), queries[None],
                            copy.deepcopy(cache), 0, masks=masks)
        return head_logits(model, hidden)[0]


@pytest.mark.parametrize("until", [None, 22])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_the_biased_forward_matches_masks_built_from_absolute_positions(family: str, until: int | None) -> None:
    # the model's own cache layout (Gemma-3: sliding layers holding the last 7 of 20 tokens),
    # so the bias must find its columns past each layer's offset
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    layout = _cache(lm.model, ids[:, :20], lambda: DynamicCache(config=lm.config))
    every = _cache(lm.model, ids[:, :20], full_cache)
    bias = AttentionBias(BIASED, 0.7, until)  # until 22: the first two fed tokens only
    fed = ids[0, 20:].tolist()
    with torch.no_grad():
        got = forward_at(lm.model, fed, 20, layout, keep=0, bias=bias)
        plain = forward_at(lm.model, fed, 20, copy.deepcopy(_cache(lm.model, ids[:, :20], full_cache)), keep=0)
    want = _reference(lm.model, every, 20, fed, bias)
    torch.testing.assert_close(got.logits[0], want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got.logits[0], plain.logits[0], atol=1e-3)  # the bias did something
    if until is not None:  # the rows after `until` are not biased, but read biased rows before them
        everywhere = _reference(lm.model, every, 20, fed, AttentionBias(BIASED, 0.7))
        torch.testing.assert_close(got.logits[0, :2], everywhere[:2], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got.logits[0, 2:], everywhere[2:], atol=1e-3)
    assert got.cache is layout and layout.get_seq_length() == 24  # extended in place, as the model's forward


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_bias_of_log_2_reads_a_token_as_if_it_were_cached_twice(family: str) -> None:
    """Softmax weights: exp(s + ln 2) = 2 exp(s). A cache holding each biased entry twice
    (same key, same value; full attention) must give the same logits: the bias's meaning,
    checked without any mask code."""
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = _cache(lm.model, ids[:, :20], full_cache)
    order = torch.tensor([p for p in range(20) for _ in range(2 if p in BIASED.tolist() else 1)])
    doubled = full_cache()
    for i, layer in enumerate(cache.layers):
        doubled.update(layer.keys[:, :, order], layer.values[:, :, order], i)
    with torch.no_grad():
        want = lm.model(input_ids=ids[:, 20:], cache=doubled, position_ids=torch.arange(20, 24)[None],
                        use_cache=True).logits[0]
        got = forward_at(lm.model, ids[0, 20:].tolist(), 20, cache, keep=0,
                         bias=AttentionBias(BIASED, math.log(2))).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("kinds", [None, frozenset({"full_attention"})])
@pytest.mark.parametrize("per_layer", [False, True])
def test_feed_biases_the_prompt_not_the_entries_it_recomputes(family: str, kinds: frozenset[str] | None,
                                                              per_layer: bool) -> None:
    """Stale entries recomputed in the prompt's forward are computed as `refresh_tokens`
    computes them (no bias); the prompt's rows are biased (in the layers of `kinds`, scaled
    per layer and head by a `per_layer` table): one forward equals the two."""
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 25), generator=torch.Generator().manual_seed(2))
    stale = {p: int(ids[0, p]) for p in (4, 9, 15)}
    cache = _cache(lm.model, ids[:, :20], full_cache)
    for layer in cache.layers:  # placeholders at the stale positions
        layer.keys[:, :, sorted(stale)] = 0
        layer.values[:, :, sorted(stale)] = 0
    table = torch.randn(len(decoder_of(lm.model).layers), lm.config.num_attention_heads,
                        generator=torch.Generator().manual_seed(7)) if per_layer else None
    bias = AttentionBias(BIASED, -0.5, None, kinds, per_layer=table)
    prompt = ids[0, 20:].tolist()
    _, got = feed(lm.model, copy.deepcopy(cache), 20, prompt, stale, keep=0, bias=bias)
    first = copy.deepcopy(cache)
    with torch.no_grad():
        refresh_tokens(lm.model, first, list(stale.values()), sorted(stale))
        plain = forward_at(lm.model, prompt, 20, copy.deepcopy(first), keep=0,
                           bias=bias._replace(per_layer=None)).logits[0]
        want = forward_at(lm.model, prompt, 20, first, keep=0, bias=bias).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert per_layer != torch.allclose(got, plain, atol=1e-3)  # the table acts where there is one


def test_a_zero_bias_is_the_models_own_forward_and_a_bias_needs_a_cache() -> None:
    lm = tiny("qwen2")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = _cache(lm.model, ids[:, :8], full_cache)
    with torch.no_grad():
        got = forward_at(lm.model, ids[0, 8:].tolist(), 8, copy.deepcopy(cache), keep=0,
                         bias=AttentionBias(BIASED, 0.0)).logits
        want = forward_at(lm.model, ids[0, 8:].tolist(), 8, copy.deepcopy(cache), keep=0).logits
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="needs a cache"):
        forward_at(lm.model, [5, 6], 0, None, bias=AttentionBias(BIASED, 0.5))


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention", "rest:full_attention"])
def test_a_bias_kept_to_one_attention_kind_leaves_the_other_layers_unbiased(kind: str) -> None:
    lm = tiny("gemma3_text")  # sliding, sliding, full, sliding
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    fed = ids[0, 20:].tolist()
    every = _cache(lm.model, ids[:, :20], full_cache)
    bias = AttentionBias(BIASED, 0.7, None, frozenset({kind}))
    if kind.startswith("rest:"):  # the first two fed tokens in every layer, the last two in the full ones
        bias = AttentionBias(BIASED, 0.7, 22, None, frozenset({kind[len("rest:"):]}))
    with torch.no_grad():
        got = forward_at(lm.model, fed, 20, _cache(lm.model, ids[:, :20], lambda: DynamicCache(config=lm.config)),
                         keep=0, bias=bias).logits[0]
        plain = forward_at(lm.model, fed, 20, copy.deepcopy(every), keep=0).logits[0]
    torch.testing.assert_close(got, _reference(lm.model, every, 20, fed, bias), atol=1e-4, rtol=1e-4)
    everywhere = _reference(lm.model, every, 20, fed, AttentionBias(BIASED, 0.7))
    assert not torch.allclose(got, plain, atol=1e-3) and not torch.allclose(got, everywhere, atol=1e-3)


def test_bias_scope_parser_reads_the_queries_and_the_layers_and_refuses_the_rest():
    assert parse_bias_scope("all") == BiasScope(None, None)
    assert parse_bias_scope("question") == BiasScope(0, None)
    assert parse_bias_scope("answer0").answer_tokens == 0 and parse_bias_scope("answer12").answer_tokens == 12
    assert parse_bias_scope("sliding") == BiasScope(None, frozenset({"sliding_attention"}))
    assert parse_bias_scope("answer4,full") == parse_bias_scope("full,answer4") == BiasScope(4, frozenset({"full_attention"}))
    assert parse_bias_scope("question,rest:full") == BiasScope(0, None, frozenset({"full_attention"}))
    assert parse_bias_scope("hard0.33") == BiasScope(None, None, frozenset(), 0.33)
    assert parse_bias_scope("question,hard1").hard == 1.0
    assert parse_bias_scope("fitted") == BiasScope(None, None, frozenset(), None, True)
    assert parse_bias_scope("answer4,rest:full,fitted").fitted and not parse_bias_scope("answer4").fitted
    for bad_share in ("hard0", "hard1.5", "hardx", "hard"):
        with pytest.raises(ValueError, match="share in"):
            parse_bias_scope(bad_share)
    for bad in ("", "answer", "answer-1", "answers4", "All", "all,question", "sliding,full", "all,", "all, sliding",
                "question,rest:full,rest:sliding", "question,rest:", "question,rest:all", "fitted,fitted", "fit"):
        with pytest.raises(ValueError, match="all, question or answerK"):
            parse_bias_scope(bad)
    for needs_queries in ("rest:full", "all,rest:full", "sliding,rest:sliding"):
        with pytest.raises(ValueError, match="after question or answerK"):
            parse_bias_scope(needs_queries)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_a_per_layer_table_scales_the_bias_in_each_layer_and_head(family: str) -> None:
    lm = tiny(family)
    heads = lm.config.num_attention_heads
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(4))
    fed = ids[0, 20:].tolist()
    every = _cache(lm.model, ids[:, :20], full_cache)
    table = torch.randn(len(decoder_of(lm.model).layers), heads, generator=torch.Generator().manual_seed(5))
    bias = AttentionBias(BIASED, 0.7, 22, None, frozenset({"full_attention"}), table)
    with torch.no_grad():
        got = forward_at(lm.model, fed, 20, _cache(lm.model, ids[:, :20], lambda: DynamicCache(config=lm.config)),
                         keep=0, bias=bias).logits[0]
        ones = forward_at(lm.model, fed, 20, copy.deepcopy(every), keep=0,
                          bias=bias._replace(per_layer=torch.ones_like(table))).logits[0]
    torch.testing.assert_close(got, _reference(lm.model, every, 20, fed, bias), atol=1e-4, rtol=1e-4)
    # a table of ones is the plain bias; any other table differs from it
    torch.testing.assert_close(ones, _reference(lm.model, every, 20, fed, bias._replace(per_layer=None)),
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, ones, atol=1e-3)
