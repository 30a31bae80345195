"""MoT translator: shapes for every family pair, exact layer 0, k-norm manifold, routing, artifacts."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import chunk_block, FAMILIES, tiny_model  # noqa: E402

from cagkv.errors import TranslatorError  # noqa: E402
from cagkv.translate import Translator, find_translator, list_translators, load_translator, save_artifact  # noqa: E402
from cagkv.translate.features import TargetSide  # noqa: E402
from cagkv.translate.layermap import layer_groups, layer_map  # noqa: E402
from cagkv.translate.dispatch import dispatch_experts  # noqa: E402
from cagkv.translate.mot import MoTConfig, MoTTranslator, grown_state  # noqa: E402
from cagkv.translate.train import TrainConfig, make_mot_config  # noqa: E402
from cagkv.align import token_offsets  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. Naïve café owners in Zürich sell crème brûlée."


def _translator(src, tgt, **kw) -> Translator:
    torch.manual_seed(0)
    opts = dict(d_model=16, d_expert=24, experts=3, top_k=2, group_size=2, skip_rank=0)
    opts.update(kw)
    cfg = make_mot_config(src, tgt, TrainConfig(**opts))
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    return Translator(MoTTranslator(cfg), card)


def test_layer_map_relative_depth() -> None:
    lm = layer_map(30, 18, nearest=2)
    assert lm[0] == [0, 1] and lm[17][0] == 29 and len(lm) == 18
    assert all(len(r) == 2 for r in lm)
    assert layer_map(4, 1, nearest=1) == [[3]]
    assert layer_groups([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


@pytest.mark.parametrize("src_f,tgt_f", [p for p in itertools.product(FAMILIES, FAMILIES) if p[0] != p[1]])
def test_shapes_and_dtypes_every_pair(src_f: str, tgt_f: str) -> None:
    src, tgt = tiny_model(src_f, 4), tiny_model(tgt_f, 3 if tgt_f == "qwen2" else 5)
    tr = _translator(src, tgt)
    block = chunk_block(src, TEXT)
    out = tr.translate(block, tgt)
    ids, offs = token_offsets(tgt.tokenizer, TEXT)
    s = tgt.spec
    assert out.keys.shape == (s.num_layers, s.num_kv_heads, ids.numel(), s.head_dim)
    assert out.values.shape == out.keys.shape
    assert out.keys.dtype == next(tgt.model.parameters()).dtype
    assert torch.equal(out.token_ids, ids) and torch.equal(out.offsets, offs)
    assert out.model_fingerprint == tgt.fingerprint and out.text == TEXT
    assert bool(torch.isfinite(out.keys).all())


def test_layer0_exact_and_k_norm_manifold() -> None:
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    tr = _translator(src, tgt)
    native = chunk_block(tgt, TEXT)
    out = tr.translate(chunk_block(src, TEXT), tgt)
    torch.testing.assert_close(out.keys[0], native.keys[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.values[0], native.values[0], rtol=1e-4, atol=1e-4)
    # translated keys went through the target's k-norm: per-head RMS of key / scale is 1
    ts = TargetSide(tgt.model)
    for layer in range(1, tgt.spec.num_layers):
        u = out.keys[layer] / ts.k_scale(layer)
        rms = u.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)


def test_batch_equals_single_and_padding_is_inert() -> None:
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    tr = _translator(src, tgt)
    short, long = chunk_block(src, "Rivers flow to the sea."), chunk_block(src, TEXT)
    both = tr.translate_many([short, long], tgt)
    alone = tr.translate(short, tgt)
    torch.testing.assert_close(both[0].keys, alone.keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(both[0].values, alone.values, rtol=1e-4, atol=1e-5)


def test_router_topk_and_balance_loss() -> None:
    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), group_size=2, d_model=8, d_expert=8, experts=4, top_k=2)
    mot = MoTTranslator(cfg)
    out = mot(torch.randn(2, 7, len(cfg.used_src) * 16), torch.randn(2, 7, 12))
    assert out.y.shape == (2, 4, 7, 16)
    assert out.expert_load.shape == (len(cfg.groups), 4)
    torch.testing.assert_close(out.expert_load.sum(1), torch.ones(len(cfg.groups)))
    assert float(out.aux_loss.detach()) >= 1.0 - 1e-5  # Switch loss is >= 1 with equality when balanced


def test_single_expert_ablation_and_dispatch_equivalence() -> None:
    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), d_model=8, d_expert=8, experts=1, top_k=1)
    mot = MoTTranslator(cfg)
    with torch.no_grad():
        mot.b1.normal_()
        mot.b2.normal_()
    src, emb = torch.randn(1, 5, len(cfg.used_src) * 16), torch.randn(1, 5, 12)
    out = mot(src, emb)
    assert float(out.aux_loss) == 1.0 and torch.equal(out.expert_load, torch.ones(len(cfg.groups), 1))
    # one expert per group skips the router: the same as routing every token to its group's expert
    h = torch.randn(len(cfg.groups), 2, 5, 8)
    mixed, _, _ = mot._experts(h, torch.ones(2, 5, dtype=torch.bool), mot.router_norm, mot.router,
                               (mot.W1, mot.b1, mot.W2, mot.b2))
    group = torch.arange(len(cfg.groups)).view(-1, 1).expand(-1, 10).reshape(-1, 1)
    for impl in ("dense", "loop"):
        routed = dispatch_experts(h.reshape(-1, 8), group, torch.ones(group.shape), mot.W1, mot.b1, mot.W2, mot.b2, impl=impl)
        torch.testing.assert_close(mixed, h + routed.view_as(h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grow", [{"d_expert": 20}, {"blocks": 3}, {"d_expert": 16, "blocks": 2}])
def test_grown_translator_computes_what_it_grew_from_and_trains_its_new_part(grow: dict) -> None:
    torch.manual_seed(0)
    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), group_size=2, d_model=8, d_expert=8, experts=2, top_k=1)
    small = MoTTranslator(cfg)
    src, emb = torch.randn(2, 6, len(cfg.used_src) * 16), torch.randn(2, 6, 12)
    big = MoTTranslator(MoTConfig.from_dict({**cfg.to_dict(), **grow}))
    state = grown_state(big, small.state_dict())
    assert big.load_state_dict(state, strict=False).unexpected_keys == []
    before = small(src, emb)
    after = big(src, emb)
    torch.testing.assert_close(after.y, before.y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after.hidden, before.hidden, rtol=1e-5, atol=1e-6)
    # what was grown gets gradients: the new hidden units' second layer, each new round's experts
    after.y.square().mean().backward()
    if "d_expert" in grow:
        assert float(big.W2.grad[:, cfg.d_expert:].abs().sum()) > 0
    for rnd in big.rounds:
        assert float(rnd.W2.grad.abs().sum()) > 0 and float(rnd.mix[0].proj.weight.grad.abs().sum()) > 0
    # a narrower translator cannot take the wider experts: those tensors are left out, not cut
    if "d_expert" in grow:
        assert "W1" not in grown_state(small, big.state_dict())


def test_one_expert_upcycled_to_several_computes_the_same_and_its_experts_part() -> None:
    torch.manual_seed(0)
    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), group_size=2, d_model=8, d_expert=8, experts=1, top_k=1,
                    blocks=2)
    single = MoTTranslator(cfg)
    with torch.no_grad():  # non-zero second layers, so the experts' outputs count
        single.W2.normal_()
        single.rounds[0].W2.normal_()
    src, emb = torch.randn(2, 6, len(cfg.used_src) * 16), torch.randn(2, 6, 12)
    many = MoTTranslator(MoTConfig.from_dict({**cfg.to_dict(), "experts": 4, "top_k": 2}))
    state = grown_state(many, single.state_dict())
    assert set(state) == set(many.state_dict())  # every tensor placed: nothing falls back to zero heads
    many.load_state_dict(state)
    assert torch.equal(many.W1[4:8], single.W1[1:2].expand(4, -1, -1))  # group 1's four copies
    before, after = single(src, emb), many(src, emb)
    torch.testing.assert_close(after.y, before.y, rtol=1e-5, atol=1e-6)
    assert bool((after.expert_load > 0).sum(-1).ge(2).all())  # the fresh router spreads tokens
    # tokens routed apart give the copies different gradients: they part after a step
    after.y.square().mean().backward()
    g = many.W1.grad.view(len(cfg.groups), 4, *many.W1.shape[1:])
    assert float((g[:, 0] - g[:, 1]).abs().sum()) > 0


def test_config_rejects_unknown_keys() -> None:
    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1))
    with pytest.raises(ValueError, match="unknown translator config keys"):
        MoTConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="top_k"):
        MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), experts=2, top_k=3)
    with pytest.raises(ValueError, match="blocks"):
        MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), blocks=0)


def test_artifact_round_trip_and_fingerprint_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    tr = _translator(src, tgt)
    card = {"source": {"name": src.name, "fingerprint": src.fingerprint},
            "target": {"name": tgt.name, "fingerprint": tgt.fingerprint},
            "quality": {"value": 0.7, "auto_threshold": 0.5}}
    folder = save_artifact(tmp_path / "translators" / "a__b", tr.model, card)
    loaded = load_translator(folder, src.fingerprint, tgt.fingerprint)
    block = chunk_block(src, TEXT)
    torch.testing.assert_close(loaded.translate(block, tgt).keys, tr.translate(block, tgt).keys, rtol=2e-2, atol=2e-2)
    assert loaded.auto_ok and loaded.quality == 0.7
    with pytest.raises(TranslatorError, match="target model"):
        load_translator(folder, src.fingerprint, "0" * 16)
    with pytest.raises(TranslatorError, match="source model"):
        load_translator(folder, "f" * 16, tgt.fingerprint)
    other = tiny_model("qwen2", 3)
    with pytest.raises(TranslatorError, match="target model"):
        loaded.translate(block, other)
    with pytest.raises(TranslatorError, match="block was made by"):
        loaded.translate(chunk_block(other, TEXT), tgt)
    monkeypatch.setenv("CAGKV_HOME", str(tmp_path))
    assert find_translator(src.fingerprint, tgt.fingerprint) is not None
    assert find_translator(src.fingerprint, other.fingerprint) is None
    rows = [r for r in list_translators() if r["path"] == str(folder)]
    assert rows and rows[0]["quality"] == 0.7
    # what `ask` does with it by default: no refresh, contrast, no table
    assert (rows[0]["default_refresh"], rows[0]["default_refresh_scoring"]) == (0.0, "contrast")
    assert rows[0]["difficulty_table"] is False and rows[0]["peak_z"] is None


def test_listing_shows_the_cards_defaults_as_the_translator_reads_them(tmp_path: Path, monkeypatch) -> None:
    from cagkv.cli.app import app
    from cagkv.refresh import PEAK_Z
    from cagkv.translate.difficulty import save_difficulty
    from typer.testing import CliRunner

    src, tgt = tiny_model("llama", 4), tiny_model("qwen2", 3)
    card = {"source": {"name": "src", "fingerprint": src.fingerprint},
            "target": {"name": "tgt", "fingerprint": tgt.fingerprint},
            "default_refresh": 0.33, "default_refresh_scoring": "adaptive", "difficulty": {"peak_z": 20.0},
            "attention_bias": 1.5, "attention_bias_r0": "-0.25", "attention_bias_r0_scope": "answer4"}
    folder = save_artifact(tmp_path / "translators" / "src__tgt", _translator(src, tgt).model, card)
    monkeypatch.setenv("CAGKV_HOME", str(tmp_path))

    def row():
        loaded = load_translator(folder)
        listed = [r for r in list_translators() if r["path"] == str(folder)][0]
        return loaded, listed

    loaded, listed = row()  # adaptive needs the table this folder lacks: contrast, as ask would run it
    assert listed["default_refresh_scoring"] == loaded.default_refresh_scoring == "contrast"
    assert listed["default_refresh"] == loaded.default_refresh == 0.33
    assert not listed["difficulty_table"] and listed["peak_z"] is None
    assert listed["attention_bias"] == loaded.attention_bias == 1.5
    assert listed["attention_bias_r0"] == loaded.attention_bias_r0 == -0.25
    assert listed["attention_bias_r0_scope"] == loaded.attention_bias_r0_scope == "answer4"
    save_difficulty({"difficulty": torch.ones(tgt.config.vocab_size), "count": torch.zeros(tgt.config.vocab_size)}, folder)
    loaded, listed = row()
    assert listed["default_refresh_scoring"] == loaded.default_refresh_scoring == "adaptive"
    assert listed["difficulty_table"] and listed["peak_z"] == loaded.peak_z == 20.0 != PEAK_Z
    out = CliRunner().invoke(app, ["translators", "list"])
    assert out.exit_code == 0, out.output
    line = next(l for l in out.output.splitlines() if str(folder) in l)
    assert "0.33 adaptive" in line and "yes (z 20)" in line and " 1.5/-0.25:answer4 " in line


def test_default_refresh_reads_the_card_and_ignores_what_is_not_a_share() -> None:
    tr = _translator(tiny_model("llama", 4), tiny_model("qwen2", 3))
    for value, want in ((None, 0.0), (0.2, 0.2), ("0.33", 0.33), (1.5, 0.0), (-0.1, 0.0), ("loud", 0.0), ([1], 0.0)):
        tr.card = {} if value is None else {"default_refresh": value}
        assert tr.default_refresh == pytest.approx(want), value


def test_attention_bias_reads_the_card_and_ignores_what_is_not_a_finite_number() -> None:
    tr = _translator(tiny_model("llama", 4), tiny_model("qwen2", 3))
    for value, want in ((None, 0.0), (1.5, 1.5), ("-0.25", -0.25), ("loud", 0.0), (float("inf"), 0.0), ([1], 0.0)):
        tr.card = {} if value is None else {"attention_bias": value}
        assert tr.attention_bias == pytest.approx(want), value
        assert tr.attention_bias_r0 == 0.0  # read apart: the refresh one never stands in for it
        tr.card = {} if value is None else {"attention_bias_r0": value}
        assert tr.attention_bias_r0 == pytest.approx(want) and tr.attention_bias == 0.0, value
    for scope, want in ((None, "all"), ("answer4", "answer4"), ("question", "question"), ("answer-1", "all"), (3, "all")):
        tr.card = {} if scope is None else {"attention_bias_r0_scope": scope}
        assert tr.attention_bias_r0_scope == want and tr.attention_bias_scope == "all", scope


def test_malformed_card_refused(tmp_path: Path) -> None:
    (tmp_path / "card.json").write_text("{not json")
    with pytest.raises(TranslatorError, match="not valid JSON"):
        load_translator(tmp_path)


def test_interpolated_translator_weights_lie_between_the_two_and_buffers_must_agree() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from interpolate_translators import interpolate

    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), d_model=8, d_expert=8, experts=2, top_k=1)
    torch.manual_seed(0)
    a = MoTTranslator(cfg)
    torch.manual_seed(1)
    b = MoTTranslator(cfg)
    src, emb = torch.randn(1, 6, len(cfg.used_src) * 2 * 8), torch.randn(1, 6, 12)
    mid = MoTTranslator(cfg)
    for t, want in ((0.0, a), (1.0, b)):
        mid.load_state_dict(interpolate(a, b, t))
        with torch.no_grad():
            torch.testing.assert_close(mid(src, emb).y, want(src, emb).y)
    mid.load_state_dict(interpolate(a, b, 0.5))
    torch.testing.assert_close(mid.head_w, (a.head_w + b.head_w) / 2)
    assert not torch.allclose(mid.head_w, a.head_w)
    with torch.no_grad():
        b.tgt_std.mul_(2)  # another normalisation: the weights would not mean the same thing
    with pytest.raises(ValueError, match="tgt_std"):
        interpolate(a, b, 0.5)


def test_a_single_expert_interpolates_with_its_upcycled_continuation() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from interpolate_translators import upcycled_like

    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), d_model=8, d_expert=8, experts=1, top_k=1)
    torch.manual_seed(0)
    a = MoTTranslator(cfg).eval()
    with torch.no_grad():
        a.W2.normal_()
    b = MoTTranslator(MoTConfig.from_dict({**cfg.to_dict(), "experts": 3, "top_k": 2})).eval()
    grown = upcycled_like(a, b)
    src, emb = torch.randn(1, 6, len(cfg.used_src) * 2 * 8), torch.randn(1, 6, 12)
    with torch.no_grad():
        torch.testing.assert_close(grown(src, emb).y, a(src, emb).y, rtol=1e-5, atol=1e-6)
    assert torch.equal(grown.router[0].weight, b.router[0].weight)
    with pytest.raises(ValueError, match="different configs"):
        upcycled_like(a, MoTTranslator(MoTConfig.from_dict({**cfg.to_dict(), "experts": 3, "d_model": 16})))


def test_a_translator_interpolates_with_its_native_below_continuation() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from interpolate_translators import interpolate, upcycled_like

    cfg = MoTConfig(4, 8, 5, 1, 8, 12, layer_map(4, 5, 1), d_model=8, d_expert=8, experts=1, top_k=1, tgt_hidden=12)
    torch.manual_seed(0)
    a = MoTTranslator(cfg).eval()
    b = MoTTranslator(MoTConfig.from_dict({**cfg.to_dict(), "native_below": 2})).eval()
    with torch.no_grad():
        b.res_proj.normal_()
    a_like = upcycled_like(a, b)
    src, emb, res = torch.randn(1, 6, len(cfg.used_src) * 2 * 8), torch.randn(1, 6, 12), torch.randn(1, 6, 12)
    with torch.no_grad():
        torch.testing.assert_close(a_like(src, emb, residual=res).y, a(src, emb).y)  # the projection at zero
        half = interpolate(a_like, b, 0.5)
    torch.testing.assert_close(half["res_proj"], b.res_proj / 2)
    with pytest.raises(ValueError, match="different configs"):
        upcycled_like(b, a)


def test_an_ensemble_averages_its_members_translations_even_when_installed_on_one_of_them() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from ensemble_probe import ensemble_translate

    class Member:
        def __init__(self, scale: float) -> None:
            self.scale = scale

        def translate_batch(self, bt):
            return bt["x"] * self.scale, bt["x"] * -self.scale, f"out{self.scale}"

    members = [Member(1.0), Member(2.0), Member(6.0)]
    members[0].translate_batch = ensemble_translate(members)  # as main() installs it on its host
    bt = {"x": torch.arange(4.0)}
    keys, values, out = members[0].translate_batch(bt)
    torch.testing.assert_close(keys, bt["x"] * 3.0)
    torch.testing.assert_close(values, bt["x"] * -3.0)
    assert out == "out1.0"  # the host's own output rides along (its aux terms are not averaged)
