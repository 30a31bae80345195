"""HF cache <-> position-free tensors on tiny random models of every family."""

from __future__ import annotations

import pytest
import torch

from cagkv.models import append_kv, build_cache, extract_kv, full_cache
from cagkv.models.cache import layer_span

from tiny_lms import build_tiny, tiny

TOL = 1e-4  # fp32 logits of tiny models (values are O(1..10))


def _next_logits(model, last_id, cache, position=None):
    kwargs = {} if position is None else {"position_ids": torch.tensor([[position]])}
    with torch.no_grad():
        return model(last_id, cache=cache, use_cache=True, **kwargs).logits[0, -1]


def _prefill(model, ids, cache=None, position_ids=None):
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True, **kwargs)


@pytest.mark.parametrize("T", [6, 20])
def test_extract_rebuild_gives_same_logits(tiny_lm, T):
    # T=20 is longer than the tiny Gemma-3's 8-token window.
    torch.manual_seed(T)
    ids = torch.randint(0, 97, (1, T + 1))
    model, spec = tiny_lm.model, tiny_lm.spec
    native = _prefill(model, ids[:, :-1])  # the model's own cache (sliding layers trimmed)
    ref = _next_logits(model, ids[:, -1:], native.cache)
    pos = torch.arange(T)
    K, V = extract_kv(_prefill(model, ids[:, :-1], cache=full_cache()).cache, spec, pos)
    assert K.shape == V.shape == (spec.num_layers, spec.num_kv_heads, T, spec.head_dim)
    rebuilt = build_cache(tiny_lm.config, spec, K, V, pos)
    got = _next_logits(model, ids[:, -1:], rebuilt)
    torch.testing.assert_close(got, ref, rtol=0, atol=TOL)
    if spec.rope[0] is not None:  # negative control: wrong positions change the answer
        wrong = build_cache(tiny_lm.config, spec, K, V, pos + 3)
        assert (_next_logits(model, ids[:, -1:], wrong, position=T) - ref).abs().max() > 100 * TOL


def test_sliding_layers_carry_true_length():
    lm = tiny("gemma3_text")
    T = 20
    K = torch.randn(lm.spec.num_layers, lm.spec.num_kv_heads, T, lm.spec.head_dim)
    cache = build_cache(lm.config, lm.spec, K, K.clone(), torch.arange(T))
    for i, w in enumerate(lm.spec.sliding_window):
        lay = cache.layers[i]
        assert lay.get_seq_length() == T
        if w is None:
            assert lay.keys.shape[-2] == T and not lay.is_sliding
        else:
            assert lay.is_sliding and lay.cumulative_length == T
            assert lay.keys.shape[-2] == w - 1  # the window the model itself keeps
            assert layer_span(cache, i) == (T - (w - 1), T)
    assert cache.get_seq_length() == T


def test_native_sliding_cache_matches_model_and_refuses_lost_tokens():
    lm = tiny("gemma3_text")
    ids = torch.randint(0, 97, (1, 20))
    native = _prefill(lm.model, ids).cache
    with pytest.raises(ValueError, match="full_cache"):
        extract_kv(native, lm.spec, torch.arange(20))
    # the last window-1 tokens are still there on every layer, and equal the full cache's
    pos = torch.arange(13, 20)
    K, V = extract_kv(native, lm.spec, pos)
    Kf, Vf = extract_kv(_prefill(lm.model, ids, cache=full_cache()).cache, lm.spec, pos)
    torch.testing.assert_close(K, Kf, rtol=0, atol=1e-5)
    torch.testing.assert_close(V, Vf, rtol=0, atol=1e-5)


def test_extracted_keys_are_position_free(pre_rope_keys):
    lm = tiny("gemma3_text")
    ids = torch.randint(0, 97, (1, 12))
    keys, out = pre_rope_keys(lm.model, "gemma3_text", ids, cache=full_cache())
    K, _ = extract_kv(out.cache, lm.spec, torch.arange(12))
    for i in range(lm.spec.num_layers):
        torch.testing.assert_close(K[i], keys[i][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift", [0, 37])
def test_chunk_after_prefix_placed_back(tiny_rope_lm, shift):
    """Prefix + chunk prefilled at [0, P+C), stored position-free; the chunk placed after the
    prefix at the same positions (shift 0) reproduces the model's logits, and the whole block
    placed at [s, s+P+C) equals the model's own prefill at those positions."""
    model, spec = tiny_rope_lm.model, tiny_rope_lm.spec
    P, C = 3, 10
    torch.manual_seed(shift)
    ids = torch.randint(0, 97, (1, P + C + 1))
    # stored: the chunk only, prefilled after the prefix
    out = _prefill(model, ids[:, : P + C], cache=full_cache())
    Kc, Vc = extract_kv(out.cache, spec, torch.arange(P, P + C))  # the last C entries
    Kp, Vp = extract_kv(out.cache, spec, torch.arange(P), start=0)
    # native reference at the target positions
    pos = torch.arange(shift, shift + P + C + 1)[None]
    ref = _prefill(model, ids, position_ids=pos).logits[0, -1]
    # assemble: prefix then chunk, each rotated to where it sits
    cache = build_cache(tiny_rope_lm.config, spec, Kp, Vp, torch.arange(shift, shift + P))
    append_kv(cache, spec, Kc, Vc, torch.arange(shift + P, shift + P + C))
    got = _next_logits(model, ids[:, -1:], cache, position=shift + P + C)
    torch.testing.assert_close(got, ref, rtol=0, atol=TOL)


def test_chunk_after_native_prefix():
    """A native prefix cache extended by a stored chunk equals the full native prefill."""
    lm = tiny("llama")
    ids = torch.randint(0, 97, (1, 16))
    P = 4
    Kc, Vc = extract_kv(_prefill(lm.model, ids[:, :-1]).cache, lm.spec, torch.arange(P, 15))
    cache = _prefill(lm.model, ids[:, :P]).cache  # computed natively, like a target's own prefix
    append_kv(cache, lm.spec, Kc, Vc, torch.arange(P, 15))
    ref = _prefill(lm.model, ids).logits[0, -1]
    torch.testing.assert_close(_next_logits(lm.model, ids[:, -1:], cache), ref, rtol=0, atol=TOL)


def test_generate_from_rebuilt_cache(tiny_lm):
    model, spec = tiny_lm.model, tiny_lm.spec
    ids = torch.randint(0, 97, (1, 12))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        native = model.generate(ids, **kw)
        K, V = extract_kv(_prefill(model, ids[:, :-1], cache=full_cache()).cache, spec, torch.arange(11))
        cache = build_cache(tiny_lm.config, spec, K, V, torch.arange(11))
        got = model.generate(ids, cache=cache, **kw)
    assert torch.equal(got, native)


def test_batched_extract_with_start():
    lm = tiny("qwen2")
    ids = torch.randint(0, 97, (2, 10))
    out = _prefill(lm.model, ids)
    K1, _ = extract_kv(out.cache, lm.spec, torch.arange(2, 6), batch_index=1, start=2)
    Ks, _ = extract_kv(_prefill(lm.model, ids[1:, :6]).cache, lm.spec, torch.arange(2, 6))
    torch.testing.assert_close(K1, Ks, rtol=0, atol=1e-5)


def test_bfloat16_rebuild(tiny_rope_lm):
    lm = build_tiny(tiny_rope_lm.family, dtype=torch.bfloat16)
    model = lm.model
    ids = torch.randint(0, 97, (1, 15))
    native = _prefill(model, ids[:, :-1], cache=full_cache())
    pos = torch.arange(14)
    K16, V16 = extract_kv(native.cache, lm.spec, pos)  # rounded once more to bf16
    K32, V32 = extract_kv(native.cache, lm.spec, pos, dtype=torch.float32)  # exact inverse
    assert K16.dtype == torch.bfloat16 and K32.dtype == torch.float32
    exact = build_cache(lm.config, lm.spec, K32, V32, pos, dtype=torch.bfloat16)
    for i in range(lm.spec.num_layers):
        # the model's own keys, bit for bit except where its bf16 sum cancelled to exactly 0
        # (then fp32 gives ~1e-8); a one-ulp bf16 error would be >= 1e-3 here
        held = exact.layers[i].keys.shape[-2]  # sliding layers keep their window only
        torch.testing.assert_close(exact.layers[i].keys, native.cache.layers[i].keys[..., -held:, :], rtol=0, atol=1e-6)
        assert torch.equal(exact.layers[i].values, native.cache.layers[i].values[..., -held:, :]), i
    ref = _next_logits(model, ids[:, -1:], native.cache).float()
    got = _next_logits(model, ids[:, -1:], build_cache(lm.config, lm.spec, K16, V16, pos)).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_bad_shapes_raise():
    lm = tiny("llama")
    s = lm.spec
    K = torch.randn(s.num_layers, s.num_kv_heads, 5, s.head_dim)
    with pytest.raises(ValueError, match="kv heads"):
        build_cache(lm.config, s, K[:, :1], K[:, :1], torch.arange(5))
    with pytest.raises(ValueError, match="positions cover"):
        build_cache(lm.config, s, K, K, torch.arange(4))
    with pytest.raises(ValueError, match="expected K of shape"):
        build_cache(lm.config, s, K[:2], K[:2], torch.arange(5))
    with pytest.raises(ValueError, match="cannot take"):
        extract_kv(build_cache(lm.config, s, K, K, torch.arange(5)), s, torch.arange(6))
