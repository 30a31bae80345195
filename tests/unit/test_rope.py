"""RoPE per layer: frequencies equal the models' own, rotation equals the models' cached keys."""

from __future__ import annotations

import pytest
import torch

from cagkv.models import ModelSpec, full_cache, rotate, rotate_layers, unrotate, unrotate_layers
from cagkv.models.rope import rope_layer_from_config

from tiny_lms import build_tiny, tiny_config

SCALED = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def _model_rotary(model, layer_type):
    rot = model.model.rotary_emb
    if hasattr(rot, f"{layer_type}_inv_freq"):  # Gemma-3: one set per layer type
        return getattr(rot, f"{layer_type}_inv_freq"), getattr(rot, f"{layer_type}_attention_scaling")
    return rot.inv_freq, rot.attention_scaling


def test_inv_freq_matches_each_family(tiny_rope_lm):
    for i, rope in enumerate(tiny_rope_lm.spec.rope):
        inv, scale = _model_rotary(tiny_rope_lm.model, tiny_rope_lm.spec.layer_types[i])
        assert torch.equal(rope.inv_freq, inv.float().cpu()), f"layer {i}"
        assert rope.attention_scaling == pytest.approx(scale)


def test_gemma3_has_two_bases():
    spec = build_tiny("gemma3_text").spec
    bases = {t: r.base for t, r in zip(spec.layer_types, spec.rope)}
    assert bases == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    assert not spec.rope[0].same_as(spec.rope[2])


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_scaled_rope_matches_model(kind, pre_rope_keys):
    lm = build_tiny("llama", rope_parameters=dict(SCALED[kind]))
    rope = lm.spec.rope[0]
    inv, scale = _model_rotary(lm.model, "full_attention")
    assert rope.rope_type == kind
    assert torch.allclose(rope.inv_freq, inv.float(), rtol=0, atol=0)
    assert rope.attention_scaling == pytest.approx(scale)
    if kind == "yarn":
        assert rope.attention_scaling != 1.0  # the case where unrotate must undo the scaling
    ids = torch.randint(0, 97, (1, 20))
    keys, out = pre_rope_keys(lm.model, "llama", ids)
    pos = torch.arange(20)
    for i in range(lm.spec.num_layers):
        cached = out.cache.layers[i].keys
        torch.testing.assert_close(rotate(keys[i], pos, lm.spec.rope[i]), cached, rtol=0, atol=1e-6)
        torch.testing.assert_close(unrotate(cached, pos, lm.spec.rope[i]), keys[i], rtol=1e-5, atol=1e-5)


def test_rotate_of_model_keys_equals_cached_keys(tiny_rope_lm, pre_rope_keys):
    ids = torch.randint(0, 97, (2, 21))
    keys, out = pre_rope_keys(tiny_rope_lm.model, tiny_rope_lm.family, ids, cache=full_cache())
    pos = torch.arange(21)
    for i, rope in enumerate(tiny_rope_lm.spec.rope):
        cached = out.cache.layers[i].keys  # [B, H, T, D], after RoPE
        assert cached.shape == keys[i].shape
        torch.testing.assert_close(rotate(keys[i], pos, rope), cached, rtol=0, atol=1e-6)
        torch.testing.assert_close(unrotate(cached, pos, rope), keys[i], rtol=1e-5, atol=1e-5)
        # Wrong positions must not match: the test can fail.
        assert (rotate(keys[i], pos + 1, rope) - cached).abs().max() > 1e-2


def test_rotate_matches_explicit_position_ids(pre_rope_keys):
    lm = build_tiny("qwen2")
    ids = torch.randint(0, 97, (1, 9))
    pos = torch.tensor([[3, 4, 5, 40, 41, 42, 43, 100, 101]])
    keys, out = pre_rope_keys(lm.model, "qwen2", ids, position_ids=pos)
    for i, rope in enumerate(lm.spec.rope):
        torch.testing.assert_close(rotate(keys[i], pos[0], rope), out.cache.layers[i].keys, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_unrotate_then_rotate_is_identity(tiny_rope_lm, dtype, tol):
    torch.manual_seed(1)
    L, H, T, D = tiny_rope_lm.spec.num_layers, tiny_rope_lm.spec.num_kv_heads, 33, tiny_rope_lm.spec.head_dim
    k = torch.randn(L, H, T, D).to(dtype)
    pos = torch.arange(1000, 1000 + T)
    back = rotate_layers(unrotate_layers(k, pos, tiny_rope_lm.spec.rope), pos, tiny_rope_lm.spec.rope)
    assert back.dtype == dtype
    torch.testing.assert_close(back.float(), k.float(), rtol=tol, atol=tol)
    again = unrotate_layers(rotate_layers(k, pos, tiny_rope_lm.spec.rope), pos, tiny_rope_lm.spec.rope)
    torch.testing.assert_close(again.float(), k.float(), rtol=tol, atol=tol)


def test_yarn_round_trip_undoes_scaling():
    rope = build_tiny("llama", rope_parameters=dict(SCALED["yarn"])).spec.rope[0]
    k = torch.randn(2, 7, 16)
    pos = torch.arange(7)
    torch.testing.assert_close(unrotate(rotate(k, pos, rope), pos, rope), k, rtol=1e-5, atol=1e-5)


def test_relative_positions_only():
    # q.k after RoPE depends on the position difference only (what makes re-positioning valid).
    rope = tiny_config_rope()
    q, k = torch.randn(1, 16), torch.randn(1, 16)
    a = (rotate(q, torch.tensor([10]), rope) * rotate(k, torch.tensor([3]), rope)).sum()
    b = (rotate(q, torch.tensor([507]), rope) * rotate(k, torch.tensor([500]), rope)).sum()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def tiny_config_rope():
    return rope_layer_from_config(tiny_config("llama"))


def test_learned_positions_are_identity():
    spec = build_tiny("gpt2").spec
    assert spec.learned_positions and spec.rope == [None, None]
    k = torch.randn(4, 5, 16)
    assert rotate(k, torch.arange(5), None) is k
    assert unrotate(k, torch.arange(5), None) is k


def test_bad_inputs_raise():
    rope = tiny_config_rope()
    with pytest.raises(ValueError, match="head_dim"):
        rotate(torch.randn(3, 8), torch.arange(3), rope)
    with pytest.raises(ValueError, match="positions cover"):
        rotate(torch.randn(3, 16), torch.arange(4), rope)
    with pytest.raises(ValueError, match="integers"):
        rotate(torch.randn(3, 16), torch.arange(3).float(), rope)


def test_spec_rope_is_per_layer():
    spec = ModelSpec.from_config(tiny_config("gemma3_text"))
    assert [r.layer_type for r in spec.rope] == spec.layer_types
