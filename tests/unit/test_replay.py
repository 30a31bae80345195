"""Replay knob, mot-window and the streaming ridge fit, on tiny random model pairs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import chunk_block, CORPUS, tiny_model  # noqa: E402

from cagkv.align import token_offsets  # noqa: E402
from cagkv.errors import TranslatorError, UsageError  # noqa: E402
from cagkv.models.cache import extract_kv, full_cache  # noqa: E402
from cagkv.models.layers import inject_kv, run_layers  # noqa: E402
from cagkv.prompt import PromptFormat  # noqa: E402
from cagkv.translate import Translator  # noqa: E402
from cagkv.translate.folded import FoldedMoT  # noqa: E402
from cagkv.translate.mot import MoTTranslator  # noqa: E402
from cagkv.translate.pairs import prefill_kv  # noqa: E402
from cagkv.translate.ridge import RidgeFit  # noqa: E402
from cagkv.translate.train import TrainConfig, make_mot_config  # noqa: E402
from cagkv.translate.translator import LINEAR_DTYPE_ENV, linear_path_dtype, window_layers  # noqa: E402

TEXT = CORPUS[0]


def _translator(src, tgt, boundaries=(2,), **kw) -> Translator:
    torch.manual_seed(0)
    cfg = make_mot_config(src, tgt, TrainConfig(d_model=16, d_expert=24, experts=3, top_k=2, group_size=2, skip_rank=4,
                                                boundaries=list(boundaries), boundary_rank=4, **kw))
    mot = MoTTranslator(cfg)
    with torch.no_grad():
        for p in mot.parameters():
            p.normal_(0, 0.05)
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    return Translator(mot, card)


def _native_chunk_kv(tgt, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own position-free K/V of the chunk, prefilled after its context prefix."""
    ids, _ = token_offsets(tgt.tokenizer, text)
    return prefill_kv(tgt, PromptFormat.for_model(tgt).context_prefix_ids(), ids.tolist())


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_run_layers_reproduces_forward(family: str) -> None:
    m = tiny_model(family, 4)
    ids = torch.randint(3, 300, (1, 12))
    with torch.no_grad():
        c1 = full_cache()
        out = m.model(input_ids=ids, cache=c1, use_cache=True, output_hidden_states=True)
        for start in (0, 2):
            c2 = full_cache()
            if start:  # lower layers hold nothing: only layers >= start are run and compared
                h = run_layers(m.model, out.hidden_states[start], torch.arange(12)[None], c2, start)
            else:
                h = run_layers(m.model, m.model.get_input_embeddings()(ids), torch.arange(12)[None], c2, 0)
            assert torch.equal(m.model.model.norm(h), out.hidden_states[-1])
            for layer in range(start, 4):
                assert torch.equal(c2.layers[layer].keys, c1.layers[layer].keys)
                assert torch.equal(c2.layers[layer].values, c1.layers[layer].values)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_replay_full_depth_is_native_prefill(family: str) -> None:
    src, tgt = tiny_model("qwen2", 3), tiny_model(family, 4)
    tr = _translator(src, tgt)
    out = tr.translate(chunk_block(src, TEXT), tgt, replay=tgt.spec.num_layers)
    k_nat, v_nat = _native_chunk_kv(tgt, TEXT)
    torch.testing.assert_close(out.keys, k_nat, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.values, v_nat, atol=1e-6, rtol=0)
    assert tr.last_replay_ms > 0


def test_replay_zero_is_plain_translate_and_partial_replay_keeps_lower_layers() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    tr = _translator(src, tgt, boundaries=(2,))
    plain = tr.translate(chunk_block(src, TEXT), tgt)
    again = tr.translate(chunk_block(src, TEXT), tgt, replay=0)
    assert torch.equal(plain.keys, again.keys) and torch.equal(plain.values, again.values)
    assert tr.replay_values == [0, 2, 4]
    part = tr.translate(chunk_block(src, TEXT), tgt, replay=2)  # boundary layer 2: layers 2, 3 recomputed
    assert torch.equal(part.keys[:2], plain.keys[:2]) and torch.equal(part.values[:2], plain.values[:2])
    assert not torch.allclose(part.keys[2:], plain.keys[2:])
    with pytest.raises(TranslatorError, match="supports replay in"):
        tr.translate(chunk_block(src, TEXT), tgt, replay=1)
    with pytest.raises(TranslatorError, match="two different"):
        tr.translate(chunk_block(src, TEXT), tgt, replay=2, window=True)


def test_expert_fed_replay_head_reads_the_expert_state_at_inference() -> None:
    from cagkv.translate.mot import with_expert_fed_heads

    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    tr = _translator(src, tgt, boundaries=(2,))
    fed = Translator(with_expert_fed_heads(tr.model).eval(), tr.card)
    block = chunk_block(src, TEXT)
    plain, same = tr.translate(block, tgt, replay=2), fed.translate(block, tgt, replay=2)
    torch.testing.assert_close(same.keys, plain.keys)  # the read-out starts at zero
    with torch.no_grad():
        fed.model.boundary["2"].h_proj.normal_(0, 0.5)
    moved = fed.translate(block, tgt, replay=2)
    assert torch.equal(moved.keys[:2], plain.keys[:2])  # layers below the boundary: translated, unchanged
    assert not torch.allclose(moved.keys[2:], plain.keys[2:])


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_native_below_layers_are_the_targets_own_and_the_rest_reads_its_residual(family: str) -> None:
    src, tgt = tiny_model("qwen2", 3), tiny_model(family, 4)
    plain = _translator(src, tgt)
    plain.set_linear_path(torch.float32, folded=False)  # the graph the native_below translator runs
    floor = _translator(src, tgt, native_below=2)
    floor.set_linear_path(torch.float32, folded=False)
    assert not MoTTranslator(floor.model.cfg).res_proj.any()  # a new projection starts at zero
    missing, unexpected = floor.model.load_state_dict(plain.model.state_dict(), strict=False)
    assert missing == ["res_proj"] and not unexpected
    with torch.no_grad():
        floor.model.res_proj.zero_()
    block = chunk_block(src, TEXT)
    base, out = plain.translate(block, tgt), floor.translate(block, tgt)
    k_nat, v_nat = _native_chunk_kv(tgt, TEXT)
    torch.testing.assert_close(out.keys[:2], k_nat[:2], atol=1e-5, rtol=1e-5)  # computed by the target itself
    torch.testing.assert_close(out.values[:2], v_nat[:2], atol=1e-6, rtol=0)
    assert floor.last_replay_ms > 0
    # a zero projection of the residual: the layers above are the plain translator's
    torch.testing.assert_close(out.keys[2:], base.keys[2:])
    torch.testing.assert_close(out.values[2:], base.values[2:])
    with torch.no_grad():
        floor.model.res_proj.normal_(0, 0.5)
    moved = floor.translate(block, tgt)
    assert torch.equal(moved.keys[:2], out.keys[:2]) and not torch.allclose(moved.keys[2:], out.keys[2:])
    floor.set_linear_path(torch.float32)  # the folded inference form reads the residual too
    assert FoldedMoT.supports(floor.model)
    folded = floor.translate(block, tgt)
    torch.testing.assert_close(folded.keys, moved.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(folded.values, moved.values, atol=1e-4, rtol=1e-4)
    # the residual is the target's own: a translator reading it sees the chunk's other blocks' nothing,
    # so translating two blocks together gives each what it gets alone
    pair = floor.translate_many([block, chunk_block(src, CORPUS[1])], tgt)
    torch.testing.assert_close(pair[0].keys, moved.keys, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="native_below must lie"):
        _translator(src, tgt, native_below=4)
    with pytest.raises(ValueError, match="pass `residual`"):
        floor.model(torch.zeros(1, 3, len(floor.model.cfg.used_src) * 2 * floor.model.cfg.src_kv_dim),
                    torch.zeros(1, 3, floor.model.cfg.tgt_embed_dim))


def test_window_layers_cover_about_thirty_percent() -> None:
    assert window_layers(18) == [6, 7, 8, 9, 10]
    assert window_layers(24) == [8, 9, 10, 11, 12, 13, 14]
    assert window_layers(2) == [1]


def test_mot_window_fed_native_kv_reproduces_native_prefill() -> None:
    tgt = tiny_model("gemma3", 6)
    prefix = PromptFormat.for_model(tgt).context_prefix_ids()
    ids, _ = token_offsets(tgt.tokenizer, TEXT)
    k_nat, v_nat = _native_chunk_kv(tgt, TEXT)
    p, t = len(prefix), ids.numel()
    positions = torch.arange(p, p + t)
    with torch.no_grad():
        cache = full_cache()
        tgt.model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        window = window_layers(6)
        from cagkv.models.rope import rotate

        given = {l: (rotate(k_nat[l], positions, tgt.spec.rope[l])[None], v_nat[l][None]) for l in window}
        with inject_kv(cache, given):
            run_layers(tgt.model, tgt.model.get_input_embeddings()(ids[None]), positions[None], cache, 0)
        assert "update" not in cache.__dict__  # the override is gone after the block
    k, v = extract_kv(cache, tgt.spec, positions)
    torch.testing.assert_close(k, k_nat, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, v_nat, atol=1e-6, rtol=0)


def test_mot_window_uses_translated_kv_in_its_window_only() -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 6)
    tr = _translator(src, tgt, boundaries=())
    plain = tr.translate(chunk_block(src, TEXT), tgt)
    win = tr.translate(chunk_block(src, TEXT), tgt, window=True)
    layers = window_layers(6)
    torch.testing.assert_close(win.keys[layers], plain.keys[layers], atol=1e-5, rtol=1e-5)
    assert torch.equal(win.values[layers], plain.values[layers])
    k_nat, _ = _native_chunk_kv(tgt, TEXT)
    # below the window the target computed its own K/V from its own embeddings: native
    torch.testing.assert_close(win.keys[: layers[0]], k_nat[: layers[0]], atol=1e-5, rtol=1e-5)


def test_streaming_ridge_fit_resumes_and_heads_predict_hidden_state(tmp_path: Path) -> None:
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    cfg = make_mot_config(src, tgt, TrainConfig(d_model=16, d_expert=24, experts=2, top_k=1, group_size=2,
                                                skip_rank=4, boundaries=[2], boundary_rank=8))
    texts = CORPUS[:10]
    whole = RidgeFit.new(cfg)
    whole.add_texts(src, tgt, texts, stats_chunks=4)
    split = RidgeFit.new(cfg)
    split.add_texts(src, tgt, texts[:6], stats_chunks=4, save_to=tmp_path / "fit.pt")
    resumed = RidgeFit.load(tmp_path / "fit.pt")
    assert resumed.texts_done == 6
    resumed.add_texts(src, tgt, texts, stats_chunks=4)
    assert resumed.texts_done == whole.texts_done == 10 and resumed.tokens == whole.tokens
    for a, b in zip(resumed.layers, whole.layers):
        torch.testing.assert_close(a.xtx, b.xtx)
        torch.testing.assert_close(a.xty, b.xty)
    r2 = whole.r2(lam=1e-3)
    assert all(0.0 < x <= 1.0 for x in r2["layers"]) and 0.0 < r2["boundaries"]["2"] <= 1.0
    mot = whole.to_translator(lam=1e-3)
    # the replay head's training error is no worse than predicting the mean hidden state
    from cagkv.translate.ridge import chunk_arrays
    from cagkv.translate.features import TargetSide

    a = chunk_arrays(src, tgt, texts[0], [2], cfg.used_src)
    emb = TargetSide(tgt.model).embed(a["ids"][None]).float()
    with torch.no_grad():
        pred = mot.boundary_hidden(a["src"][None], emb, 2)[0]
    truth = a["hidden"][2]
    head = mot.boundary["2"]
    assert float(((pred - truth) ** 2).sum()) < float(((head.mean - truth) ** 2).sum())
    small = whole.to_translator(lam=1e-3, experts=1, top_k=1, d_model=8, d_expert=8)
    with torch.no_grad():
        torch.testing.assert_close(small.boundary_hidden(a["src"][None], emb, 2)[0], pred)
        assert torch.equal(small.src_mean, mot.src_mean) and torch.equal(small.tgt_std, mot.tgt_std)
    with pytest.raises(ValueError, match="shape the fit"):
        whole.to_translator(layer_map=[[0]] * 4)


def test_int8_linear_artifact_round_trip(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from cagkv.translate import load_translator, save_artifact

    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    torch.manual_seed(0)
    cfg = make_mot_config(src, tgt, TrainConfig(d_model=16, d_expert=24, experts=2, top_k=1, group_size=2,
                                                skip_rank=128, boundaries=[2], boundary_rank=4))
    mot = MoTTranslator(cfg)
    with torch.no_grad():
        for p in mot.parameters():
            p.normal_(0, 0.1)
    assert mot.skip_a.numel() >= 65536  # big enough to be stored as int8
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    out = save_artifact(tmp_path / "a", mot, card, int8_linear=True)
    stored = load_file(str(out / "weights.safetensors"))
    assert stored["skip_a.q8"].dtype == torch.int8 and "skip_a" not in stored
    assert stored["head_w"].dtype == torch.float16  # the mixture stays float16
    loaded = load_translator(out, src.fingerprint, tgt.fingerprint).model
    step = mot.skip_a.abs().amax(dim=-2, keepdim=True) / 127  # one quantisation step per column
    assert bool(((loaded.skip_a - mot.skip_a).abs() <= 0.5 * step + 1e-6).all())
    ids = torch.randint(3, 300, (1, 9))
    x, emb = torch.randn(1, 9, mot.src_mean.numel()), tgt.model.get_input_embeddings()(ids)
    with torch.no_grad():
        a, b = mot(x, emb).y, loaded(x, emb).y
    assert float((a - b).norm() / a.norm()) < 0.02


def linear_path_mot(skip_rank: int = 128) -> MoTTranslator:
    """An eval-mode translator (tiny Llama -> tiny Gemma-3) whose weights are all N(0, 0.1),
    so that its linear path is far from zero."""
    src, tgt = tiny_model("llama", 3), tiny_model("gemma3", 4)
    cfg = make_mot_config(src, tgt, TrainConfig(d_model=16, d_expert=24, experts=2, top_k=1, group_size=2,
                                                 skip_rank=skip_rank))
    torch.manual_seed(0)
    mot = MoTTranslator(cfg).eval()
    with torch.no_grad():
        for p in mot.parameters():
            p.normal_(0, 0.1)
    return mot


def linear_path_inputs(mot: MoTTranslator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 7, mot.src_mean.numel()), torch.randn(2, 7, mot.cfg.tgt_embed_dim)


def test_folded_linear_path_equals_the_factored_one() -> None:
    mot = linear_path_mot()
    x, emb = linear_path_inputs(mot)
    with torch.no_grad():
        ref = mot(x, emb).y
        assert mot.fold_skip()  # rank 128 > F*O/(F+O) for these sizes
        torch.testing.assert_close(mot(x, emb).y, ref, rtol=1e-4, atol=1e-5)
    mot.train()
    assert mot._skip_w is None  # training drops the folded copy
    assert not linear_path_mot(skip_rank=2).fold_skip()  # low rank: the two factors are cheaper


def test_folded_linear_path_in_bfloat16_stays_close_and_returns_float32() -> None:
    mot = linear_path_mot()
    x, emb = linear_path_inputs(mot)
    with torch.no_grad():
        ref = mot.skip(x, emb)
        assert mot.fold_skip(torch.bfloat16)
        assert all(w.dtype == torch.bfloat16 for w in mot._skip_w)
        got = mot.skip(x, emb)
    assert got.dtype == torch.float32
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < 1e-2  # bfloat16's rounding, not another computation


def test_linear_path_dtype_follows_the_cpu_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LINEAR_DTYPE_ENV, raising=False)
    for has_bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=has_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert linear_path_dtype() == want
    monkeypatch.setenv(LINEAR_DTYPE_ENV, "bfloat16")
    assert linear_path_dtype() == torch.bfloat16  # forced, although this "CPU" lacks it
    monkeypatch.setenv(LINEAR_DTYPE_ENV, "float16")
    with pytest.raises(UsageError, match="float32, bfloat16 or auto"):
        linear_path_dtype()
    mot = linear_path_mot()
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        monkeypatch.setenv(LINEAR_DTYPE_ENV, name)
        assert Translator(mot, card={}).model._skip_w[0].dtype == dtype
