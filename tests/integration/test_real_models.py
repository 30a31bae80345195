"""The foundation on the three real LMs (SmolLM2 / llama, Gemma-3, Qwen2.5 / qwen2), fp32.

Each model is loaded once for this module and released afterwards (memory: ~4 GB for
all three in fp32). Measured differences are printed (`pytest -s`) for docs/FOUNDATION.md.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors import safe_open

from cagkv.models import append_kv, build_cache, extract_kv, full_cache, rotate, unload, zoo

from tiny_lms import REAL_LMS, capture_pre_rope_keys

pytestmark = pytest.mark.integration

TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The region "
    "includes territory of nine nations, and most of the forest is within Brazil."
)
QUESTION = " Question: which country holds most of the forest? Answer:"
LOGIT_TOL = 2e-3  # fp32; measured differences are ~1e-5 (see docs/FOUNDATION.md)

EXPECTED = {  # MODELS.md: layers, kv heads, head_dim, family
    "smollm2-135m": (30, 3, 64, "llama"),
    "gemma3-270m": (18, 1, 256, "gemma3_text"),
    "qwen2.5-0.5b": (24, 2, 64, "qwen2"),
}


@pytest.fixture(scope="module", params=REAL_LMS)
def lm(request, real_model):
    loaded = real_model(request.param)
    yield loaded
    unload(request.param)  # the next model replaces it: keep memory bounded
    gc.collect()


def _ids(lm, text):
    return lm.tokenizer(text, return_tensors="pt").input_ids


def _fwd(lm, ids, **kw):
    kw.setdefault("logits_to_keep", 1)  # only the next-token logits: the vocab projection is costly
    with torch.no_grad():
        return lm.model(ids, use_cache=True, **kw)


def _report(what, lm, value):
    print(f"\n[foundation] {lm.name} ({lm.spec.family}) {what}: {value:.3g}")


def test_spec_matches_the_model_card(lm):
    s = lm.spec
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.family) == EXPECTED[lm.name]
    if s.family == "gemma3_text":
        assert [i for i, w in enumerate(s.sliding_window) if w is None] == [5, 11, 17]
        assert {w for w in s.sliding_window if w} == {512}
        assert (s.rope[0].base, s.rope[5].base) == (10000.0, 1000000.0)
        assert s.has_k_norm
    else:
        assert s.sliding_window == [None] * s.num_layers


def test_converted_folder_is_clean(lm):
    folder = zoo.model_path(lm.name)
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == (not cfg.get("tie_word_embeddings", False))
    assert json.loads((folder / "cagkv.json").read_text())["fingerprint"] == lm.fingerprint
    for name in ("tokenizer.json", "generation_config.json"):
        assert (folder / name).is_file()


def test_rotate_of_pre_rope_keys_equals_cached_keys(lm):
    ids = _ids(lm, TEXT)
    keys, out = capture_pre_rope_keys(lm.model, lm.spec.family, ids, logits_to_keep=1)
    pos = torch.arange(ids.shape[1])
    worst = 0.0
    for i, rope in enumerate(lm.spec.rope):
        cached = out.cache.layers[i].keys
        scale = cached.abs().max()
        worst = max(worst, ((rotate(keys[i], pos, rope) - cached).abs().max() / scale).item())
    _report("rotate vs cached keys (relative)", lm, worst)
    assert worst < 1e-5


def test_rebuilt_cache_gives_the_same_logits(lm):
    ids = _ids(lm, TEXT + QUESTION)
    T = ids.shape[1] - 1
    native = _fwd(lm, ids[:, :-1])
    K, V = extract_kv(native.cache, lm.spec, torch.arange(T))
    ref = _fwd(lm, ids[:, -1:], cache=native.cache).logits[0, -1]
    got = _fwd(lm, ids[:, -1:], cache=build_cache(lm.config, lm.spec, K, V, torch.arange(T))).logits[0, -1]
    diff = (got - ref).abs().max().item()
    _report(f"max |Δlogit| rebuilt vs own prefill, T={T}", lm, diff)
    assert diff < LOGIT_TOL
    assert got.argmax() == ref.argmax()


def test_gemma_longer_than_its_window(lm):
    if lm.spec.family != "gemma3_text":
        pytest.skip("only Gemma-3 has sliding-window layers")
    ids = _ids(lm, (TEXT + " ") * 20)[:, :601]
    T = ids.shape[1] - 1
    assert T > 512
    native = _fwd(lm, ids[:, :-1])  # the model's own cache: sliding layers keep 511
    ref = _fwd(lm, ids[:, -1:], cache=native.cache).logits[0, -1]
    K, V = extract_kv(_fwd(lm, ids[:, :-1], cache=full_cache()).cache, lm.spec, torch.arange(T))
    cache = build_cache(lm.config, lm.spec, K, V, torch.arange(T))
    assert cache.layers[0].cumulative_length == T and cache.layers[0].keys.shape[-2] == 511
    got = _fwd(lm, ids[:, -1:], cache=cache).logits[0, -1]
    diff = (got - ref).abs().max().item()
    _report(f"max |Δlogit| rebuilt vs own prefill, T={T} > window", lm, diff)
    assert diff < LOGIT_TOL
    # Without the true length the sliding layers would see the wrong tokens: the test can fail.
    for lay in cache.layers:
        if lay.is_sliding:
            lay.cumulative_length = 511
    bad = _fwd(lm, ids[:, -1:], cache=cache, position_ids=torch.tensor([[T]])).logits[0, -1]
    assert (bad - ref).abs().max().item() > 100 * max(diff, 1e-6)


@pytest.mark.parametrize("shift", [0, 300])
def test_chunk_after_prefix_placed_back(lm, shift):
    prefix = _ids(lm, "Context:")
    chunk = lm.tokenizer(" " + TEXT, add_special_tokens=False, return_tensors="pt").input_ids
    tail = lm.tokenizer(QUESTION, add_special_tokens=False, return_tensors="pt").input_ids[:, :1]
    P, C = prefix.shape[1], chunk.shape[1]
    out = _fwd(lm, torch.cat([prefix, chunk], 1))  # the chunk prefilled after a short prefix
    Kc, Vc = extract_kv(out.cache, lm.spec, torch.arange(P, P + C))  # stored: chunk only
    Kp, Vp = extract_kv(out.cache, lm.spec, torch.arange(P), start=0)
    ids = torch.cat([prefix, chunk, tail], 1)
    ref = _fwd(lm, ids, position_ids=torch.arange(shift, shift + P + C + 1)[None]).logits[0, -1]
    cache = build_cache(lm.config, lm.spec, Kp, Vp, torch.arange(shift, shift + P))
    append_kv(cache, lm.spec, Kc, Vc, torch.arange(shift + P, shift + P + C))
    got = _fwd(lm, tail, cache=cache, position_ids=torch.tensor([[shift + P + C]])).logits[0, -1]
    diff = (got - ref).abs().max().item()
    _report(f"max |Δlogit| chunk placed at shift {shift}", lm, diff)
    assert diff < (LOGIT_TOL if shift == 0 else 2e-2)  # shifted: RoPE of other angles, fp32 rounding
    assert got.argmax() == ref.argmax()


def test_generate_from_rebuilt_cache_equals_native(lm):
    ids = _ids(lm, TEXT + QUESTION)
    T = ids.shape[1] - 1
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id or 0)
    with torch.no_grad():
        native = lm.model.generate(ids, **kw)
        K, V = extract_kv(_fwd(lm, ids[:, :-1]).cache, lm.spec, torch.arange(T))
        got = lm.model.generate(ids, cache=build_cache(lm.config, lm.spec, K, V, torch.arange(T)), **kw)
    assert torch.equal(got, native), (lm.tokenizer.decode(got[0, T:]), lm.tokenizer.decode(native[0, T:]))
