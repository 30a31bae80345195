"""The folded inference form of a translator computes what the training graph computes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import chunk_block, CORPUS, tiny_model  # noqa: E402

from cagkv.align import token_offsets  # noqa: E402
from cagkv.translate import Translator  # noqa: E402
from cagkv.translate.features import TargetSide  # noqa: E402
from cagkv.translate.folded import FoldedMoT  # noqa: E402
from cagkv.translate.mot import MoTTranslator  # noqa: E402
from cagkv.translate.train import TrainConfig, make_mot_config  # noqa: E402
from cagkv.translate.translator import assemble_kv, prepare_inputs  # noqa: E402


def random_translator(src, tgt, **kw) -> MoTTranslator:
    """Every weight and statistic random, so no term of the fold can hide behind a zero or a one."""
    opts = dict(d_model=16, d_expert=24, experts=2, top_k=1, group_size=2, skip_rank=8)
    opts.update(kw)
    torch.manual_seed(0)
    mot = MoTTranslator(make_mot_config(src, tgt, TrainConfig(**opts))).eval()
    with torch.no_grad():
        for p in mot.parameters():
            p.normal_(0, 0.1)
        mot.src_mean.normal_(0, 2.0)
        mot.src_std.uniform_(0.5, 3.0)
        mot.tgt_mean.normal_(0, 1.0)
        mot.tgt_std.uniform_(0.5, 2.0)
    return mot


def reference_and_folded(src, tgt, mot: MoTTranslator, dtype: torch.dtype):
    ts = TargetSide(tgt.model)
    texts = [CORPUS[0], CORPUS[1][:60]]  # two lengths: the second block is padded
    blocks = [chunk_block(src, t) for t in texts]
    tokens = [token_offsets(tgt.tokenizer, t) for t in texts]
    inputs = prepare_inputs(mot, [(b.keys, b.values, b.offsets) for b in blocks], tokens)
    emb = ts.embed(inputs.ids).float()
    with torch.no_grad():
        keys, values = assemble_kv(mot, ts, mot(inputs.src, emb, inputs.mask), emb)
    ref = [(keys[i, :, :, :n], values[i, :, :, :n]) for i, n in enumerate(inputs.lengths)]
    return ref, FoldedMoT(mot, ts, dtype).kv(inputs, emb)[0]


@pytest.mark.parametrize("target_family,extra", [
    ("gemma3", {}),  # k-norm target: the norm's per-channel scale is folded in
    ("llama", {}),
    ("gemma3", {"skip_rank": 0}),  # no linear path: heads only
    ("qwen2", {"key_scale": True, "blocks": 2}),
])
def test_folded_float32_equals_the_training_graph(target_family: str, extra: dict) -> None:
    src, tgt = tiny_model("llama", 3), tiny_model(target_family, 3 if target_family == "qwen2" else 4)
    mot = random_translator(src, tgt, **extra)
    ref, folded = reference_and_folded(src, tgt, mot, torch.float32)
    for (k_ref, v_ref), (k, v) in zip(ref, folded):
        assert k.shape == k_ref.shape and k.dtype == torch.float32
        torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)


def test_folded_bfloat16_stays_within_a_percent() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    mot = random_translator(src, tgt)
    ref, folded = reference_and_folded(src, tgt, mot, torch.bfloat16)
    for (k_ref, v_ref), (k, v) in zip(ref, folded):
        assert k.dtype == torch.float32  # bfloat16 inside, the caller's dtype out
        for got, want in ((k, k_ref), (v, v_ref)):
            assert float((got - want).norm() / want.norm()) < 0.01


def test_translator_uses_the_folded_form_and_can_be_told_not_to() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    tr = Translator(random_translator(src, tgt), card)
    block = chunk_block(src, CORPUS[0])
    tr.set_linear_path(torch.float32, folded=True)
    folded = tr.translate(block, tgt)
    assert tr._folded_for == (tgt.fingerprint, torch.float32)
    tr.set_linear_path(torch.float32, folded=False)
    plain = tr.translate(block, tgt)
    torch.testing.assert_close(folded.keys, plain.keys, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(folded.values, plain.values, rtol=1e-4, atol=1e-4)


def test_warm_builds_the_folded_form_once() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    tr = Translator(random_translator(src, tgt), card)
    tr.set_linear_path(torch.bfloat16)  # whatever this CPU's default is
    tr.warm(tgt)
    built = tr._folded_mot
    tr.translate(chunk_block(src, CORPUS[0]), tgt)
    assert tr._folded_mot is built  # the translation reused it
    tr.set_linear_path(torch.float32)
    tr.warm(tgt)
    assert tr._folded_mot is not built and tr._folded_mot.dtype == torch.float32


def test_replay_and_window_read_the_folded_form_alike() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    tr = Translator(random_translator(src, tgt, boundaries=[2], boundary_rank=4), card)
    block = chunk_block(src, CORPUS[0])
    for kwargs in ({"replay": 2}, {"window": True}):
        got = {}
        for folded in (True, False):
            tr.set_linear_path(torch.float32, folded=folded)
            got[folded] = tr.translate(block, tgt, **kwargs)
        torch.testing.assert_close(got[True].keys, got[False].keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[True].values, got[False].values, rtol=1e-4, atol=1e-4)


def test_layer_streams_are_not_folded() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    mot = random_translator(src, tgt, layer_streams=[2])
    assert not FoldedMoT.supports(mot)
    with pytest.raises(ValueError, match="layer_streams"):
        FoldedMoT(mot, TargetSide(tgt.model))


def test_batched_alignment_equals_block_by_block() -> None:
    """`prepare_inputs(batched=True)` (what runs on a GPU: one gather for every block) gives
    the per-block sparse products' features, padding zeroed."""
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    mot = random_translator(src, tgt)
    texts = [CORPUS[0], CORPUS[1][:60], CORPUS[2][:25]]
    blocks = [chunk_block(src, t) for t in texts]
    tokens = [token_offsets(tgt.tokenizer, t) for t in texts]
    parts = [(b.keys, b.values, b.offsets) for b in blocks]
    want = prepare_inputs(mot, parts, tokens)
    got = prepare_inputs(mot, parts, tokens, batched=True)
    assert got.lengths == want.lengths and torch.equal(got.ids, want.ids) and torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.src, want.src, rtol=1e-6, atol=1e-6)
    assert float(want.src[1, want.lengths[1]:].abs().sum()) == 0.0
