"""Staged training on a tiny random pair: each stage lowers its own loss; only translator
weights move; pairs, KL and ridge baseline behave."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import CORPUS, tiny_model  # noqa: E402

from cagkv.translate.corpus import Continuation, Sample, make_samples, split_by_document  # noqa: E402
from cagkv.translate.linear import fit_ridge  # noqa: E402
from cagkv.translate.pairs import PairSet, build_pairs  # noqa: E402
from cagkv.translate.train import Trainer, TrainConfig, kl_topk, make_optimizer  # noqa: E402


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> PairSet:
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    samples = [
        Sample(CORPUS[0], [Continuation("follows", 'In the text, what comes right after "The quick"?', "brown fox")]),
        Sample(CORPUS[2], [Continuation("blank", 'Fill in the blank: "Rivers flow to the ___."', "sea"),
                           Continuation("next", "", CORPUS[3])]),
        Sample(CORPUS[1], [Continuation("follows", 'In the text, what comes right after "they open"?', "at nine")]),
    ]
    folder = tmp_path_factory.mktemp("pairs")
    build_pairs(src, tgt, samples, folder, topk=8, predict=5)
    return PairSet(folder)


def _trainer(pairs: PairSet, **kw) -> Trainer:
    torch.manual_seed(0)
    opts = dict(d_model=24, d_expert=32, experts=3, top_k=2, group_size=2, batch=3, e2e_accum=1, kl_positions=5,
                log_every=1000, seed=0, skip_rank=0, init="random")
    opts.update(kw)
    tr = Trainer(tiny_model("llama", 4), tiny_model("gemma3", 6), pairs, pairs, TrainConfig(**opts))
    tr.fit_stats()
    return tr


def test_pairs_content(pairs: PairSet) -> None:
    rec = pairs[1]
    assert rec["kinds"] == ["blank", "next"]
    tgt = tiny_model("gemma3", 6)
    assert rec["tgt_k"].shape[:2] == (tgt.spec.num_layers, tgt.spec.num_kv_heads)
    assert rec["src_k"].shape[2] == rec["src_off"].shape[0] and rec["tgt_k"].shape[2] == rec["tgt_ids"].numel()
    pos, ans = rec["c0_pos"], rec["c0_ans"]
    assert bool(ans[-1]) and pos[-1] == rec["c0_ids"].numel() - 2  # last prediction is the answer's last token
    assert rec["c0_q"].shape[2] == pos.numel()
    assert bool((rec["c0_w"] >= 0).all())
    assert bool((rec["c0_topv"] <= 0).all())


def test_kl_topk_matches_full_kl() -> None:
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(4, 10), torch.randn(4, 10)
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    full = (logp.exp() * (logp - logq)).sum(-1)
    top = logp.topk(10)  # K = V: the rest bucket is empty
    torch.testing.assert_close(kl_topk(logq, top.indices, top.values), full, rtol=1e-4, atol=1e-5)
    part = logp.topk(4)
    assert bool((kl_topk(logq, part.indices, part.values) <= full + 1e-5).all())  # bucketing never adds KL
    assert float(kl_topk(logp, part.indices, part.values).abs().max()) < 1e-5


def _fixed_loss(tr: Trainer, stage: str) -> float:
    with torch.no_grad():
        recs = [tr.pairs[i] for i in range(len(tr.pairs))]
        bt = tr.batch(recs)
        keys, values, _ = tr.translate_batch(bt)
        if stage == "regression":
            return float(tr.regression_loss(keys, values, bt))
        if stage == "attention":
            return float(torch.stack([tr.attention_loss(keys, values, r, i) for i, r in enumerate(recs)]).mean())
        losses = []
        for i, r in enumerate(recs):
            one = tr.batch([r])
            k1, v1, _ = tr.translate_batch(one)
            losses += [float(tr.e2e_loss(k1, v1, r, 0, j)) for j in range(len(r["kinds"]))]
        return sum(losses) / len(losses)


@pytest.mark.parametrize("stage,steps", [("regression", 30), ("attention", 20), ("e2e", 12)])
def test_each_stage_lowers_its_loss(pairs: PairSet, stage: str, steps: int) -> None:
    tr = _trainer(pairs, lr=3e-3, lr_e2e=3e-3, anchor_weight=0.0)
    if stage == "e2e":  # amplify the document's effect so the KL is not ~0 for a random target
        tr.mot.head_w.data *= 3.0
    before = _fixed_loss(tr, stage)
    getattr(tr, f"stage_{stage}")(steps, make_optimizer(tr.mot, stage, tr.cfg))
    after = _fixed_loss(tr, stage)
    assert after < before * 0.9, (stage, before, after)


def test_e2e_step_changes_only_translator(pairs: PairSet) -> None:
    tr = _trainer(pairs)
    target_before = {k: v.clone() for k, v in tr.target.model.state_dict().items()}
    mot_before = {k: v.clone() for k, v in tr.mot.state_dict().items()}
    tr.stage_e2e(2, make_optimizer(tr.mot, "e2e", tr.cfg))
    for k, v in tr.target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), f"target weight {k} changed"
    assert all(p.grad is None for p in tr.target.model.parameters())
    changed = [k for k, v in tr.mot.state_dict().items() if not torch.equal(v, mot_before[k])]
    assert any(k.startswith("W1") or k.startswith("head_w") for k in changed)


def test_answer_weight_moves_the_e2e_loss_toward_the_answer_tokens(pairs: PairSet) -> None:
    rec = next(r for r in pairs if r["kinds"] and bool(r["c0_ans"].any()) and not bool(r["c0_ans"].all()))

    def loss(answer_weight: float) -> float:
        tr = _trainer(pairs, answer_weight=answer_weight)  # same seed: the same translator each time
        keys, values, _ = tr.translate_batch(tr.batch([rec]))
        with torch.no_grad():
            return tr.e2e_loss(keys, values, rec, 0, 0).item()

    none, default, four, only = loss(0.0), loss(1.0), loss(4.0), loss(1e9)
    assert none != pytest.approx(only, rel=1e-3)  # answer and other tokens disagree here
    lo, hi = sorted((none, only))
    assert lo < default < hi and lo < four < hi
    assert abs(four - only) < abs(default - only)  # a larger weight: closer to the answer-only KL


def _native_tokens(tr: Trainer, mixed_keys: torch.Tensor, bt: dict) -> torch.Tensor:
    """`[T]`: the chunk positions whose keys in `mixed_keys` are native on every layer and head."""
    return (mixed_keys == tr.native_keys(bt)).flatten(start_dim=1, end_dim=2).all(dim=(0, 1, 3))


def test_refresh_mix_gives_a_share_of_tokens_native_kv_and_no_gradient(pairs: PairSet) -> None:
    tr = _trainer(pairs, refresh_mix=0.4)
    rec = next(r for r in pairs if r["kinds"])
    bt = tr.batch([rec])
    keys, values, _ = tr.translate_batch(bt)
    n = int(bt["lengths"][0])
    mk, mv = tr.mix_native(keys, values, bt, 0.4)
    native_v = tr.native_keys(bt, "tv")
    same = _native_tokens(tr, mk, bt)
    assert int(same[:n].sum()) == round(0.4 * n)
    picked = same.nonzero().flatten()
    assert torch.equal(mv[:, :, :, picked], native_v[:, :, :, picked])
    kept = (~same).nonzero().flatten()
    assert torch.equal(mk[:, :, :, kept], keys[:, :, :, kept]) and torch.equal(mv[:, :, :, kept], values[:, :, :, kept])
    (mk.sum() + mv.sum()).backward()
    grad = next(p for p in tr.mot.parameters() if p.grad is not None)
    assert grad is not None
    # a full mix leaves the Context Correction loss nothing to reach: the translator gets no gradient from it
    tr.mot.zero_grad(set_to_none=True)
    keys, values, _ = tr.translate_batch(bt)
    tr.e2e_loss(*tr.mix_native(keys, values, bt, 1.0), rec, 0, 0).backward()
    assert all(p.grad is None or not p.grad.any() for p in tr.mot.parameters())
    # the records drawn for training do not depend on the mix
    plain = _trainer(pairs)
    assert [tr.rng.random() for _ in range(3)] == [plain.rng.random() for _ in range(3)]


def test_refresh_mix_by_difficulty_gives_the_hardest_ids_native_kv(pairs: PairSet, tmp_path) -> None:
    from cagkv.errors import TranslatorError
    from cagkv.translate.difficulty import save_difficulty

    tr = _trainer(pairs, refresh_mix=0.4, refresh_mix_by="difficulty")
    rec = next(r for r in pairs if r["kinds"])
    bt = tr.batch([rec])
    keys, values, _ = tr.translate_batch(bt)
    with pytest.raises(TranslatorError, match="difficulty table"):  # init "random": no table to draw by
        tr.mix_native(keys, values, bt, 0.4)
    vocab = tr.target.config.vocab_size
    table = torch.randperm(vocab).float() / vocab  # distinct values: one right answer
    save_difficulty({"difficulty": table, "count": torch.ones(vocab)}, tmp_path)
    tr.cfg.init = str(tmp_path)
    n = int(bt["lengths"][0])
    mk, _ = tr.mix_native(keys, values, bt, 0.4)
    same = _native_tokens(tr, mk, bt)[:n]
    ids = bt["ids"][0, :n]
    hardest = set(torch.topk(table[ids], round(0.4 * n)).indices.tolist())
    assert set(same.nonzero().flatten().tolist()) == hardest
    with pytest.raises(TranslatorError, match="refresh_mix_by"):
        _trainer(pairs, refresh_mix_by="question")


def test_refresh_mix_share_uniform_draws_each_chunks_share_below_the_cap(pairs: PairSet) -> None:
    from cagkv.errors import TranslatorError

    tr = _trainer(pairs, refresh_mix=0.5, refresh_mix_share="uniform")
    rec = next(r for r in pairs if r["kinds"])
    bt = tr.batch([rec])
    keys, values, _ = tr.translate_batch(bt)
    n = int(bt["lengths"][0])
    assert n >= 16  # enough tokens for the shares to differ
    counts = []
    for _ in range(40):
        mk, _ = tr.mix_native(keys, values, bt, 0.5)
        counts.append(int(_native_tokens(tr, mk, bt)[:n].sum()))
    assert all(0 <= c <= round(0.5 * n) for c in counts)
    assert len(set(counts)) > 3  # the share varies from chunk to chunk
    assert min(counts) < round(0.25 * n) < max(counts)
    with pytest.raises(TranslatorError, match="refresh_mix_share"):
        _trainer(pairs, refresh_mix_share="normal")


def test_native_below_trains_on_the_targets_residual_and_keeps_its_lower_kv(pairs: PairSet) -> None:
    tr = _trainer(pairs, native_below=2)
    rec = next(r for r in pairs if r["kinds"])
    bt = tr.batch([rec])
    n = int(bt["lengths"][0])
    emb = tr.ts.embed(bt["ids"]).float()
    with torch.no_grad():
        residual = tr.lower_residual(bt, emb)
        ids = torch.cat([pairs.prefix_ids, rec["tgt_ids"]])[None]
        own = tr.target.model(input_ids=ids, output_hidden_states=True).hidden_states[2][0, tr.P :]
    torch.testing.assert_close(residual[0, :n], own.float(), atol=2e-2, rtol=2e-2)  # pairs hold the prefix in fp16
    keys, values, _ = tr.translate_batch(bt)
    assert torch.equal(keys[:, :2], tr.native_keys(bt)[:, :2]) and torch.equal(values[:, :2], tr.native_keys(bt, "tv")[:, :2])
    target_before = {k: v.clone() for k, v in tr.target.model.state_dict().items()}
    before = tr.mot.res_proj.detach().clone()
    tr.stage_e2e(2, make_optimizer(tr.mot, "e2e", tr.cfg))
    assert not torch.equal(tr.mot.res_proj, before)  # the Context Correction loss reaches the residual's projection
    for k, v in tr.target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), f"target weight {k} changed"


def test_evaluate_reports_metrics(pairs: PairSet) -> None:
    tr = _trainer(pairs)
    m = tr.evaluate()
    assert len(m["r2_per_layer"]) == 6 and m["r2_per_layer"][0] == pytest.approx(1.0, abs=1e-3)
    assert m["answers"] == 3 and m["continuation_kl"] >= 0
    # one of the four continuations is "next": its KL is one of four non-negative terms of the mean
    assert 0 <= m["continuation_kl_next"] <= 4 * m["continuation_kl"] + 1e-6


def test_ridge_baseline_fits_training_data(pairs: PairSet) -> None:
    tr = _trainer(pairs)
    before = _fixed_loss(tr, "regression")
    tr.mot = fit_ridge(tr, lam=1.0)
    assert _fixed_loss(tr, "regression") < before * 0.5


def test_samples_have_answers_from_their_chunk() -> None:
    docs = [(f"d{i}", " ".join(CORPUS[i % 5 : i % 5 + 4])) for i in range(8)]
    samples = make_samples(docs, 10, seed=1, chars=(80, 400))
    assert samples
    for s in samples:
        for c in s.conts:
            if c.kind == "follows":
                assert " ".join(c.answer.split()) in " ".join(s.text.split())
            if c.kind == "blank":
                assert "___" in c.question and c.answer in s.text
    train, held = split_by_document(samples, 0.25)
    assert not {s.source for s in train} & {s.source for s in held}


def test_ridge_init_makes_translator_equal_ridge(pairs: PairSet) -> None:
    tr = _trainer(pairs, skip_rank=512)  # full rank: the skip path reproduces ridge exactly
    lin = fit_ridge(tr, lam=1.0)
    kept = tr.mot.init_skip_from_ridge(lin.ridge_w)
    assert kept == pytest.approx(1.0, abs=1e-6)
    bt = tr.batch([pairs[0], pairs[1]])
    emb = tr.ts.embed(bt["ids"]).float()
    with torch.no_grad():
        torch.testing.assert_close(tr.mot(bt["src"], emb, bt["mask"]).y, lin(bt["src"], emb).y, rtol=1e-4, atol=1e-4)
    low = _trainer(pairs, skip_rank=4)
    assert low.mot.init_skip_from_ridge(lin.ridge_w) < 1.0  # truncation keeps part of the energy


def test_replay_in_training_matches_native_at_full_depth_and_trains_only_its_head(pairs: PairSet) -> None:
    tr = _trainer(pairs, boundaries=[4], boundary_rank=4)
    tgt = tr.target
    rec = pairs[0]
    bt = tr.batch([rec])
    tr.replay = tgt.spec.num_layers  # every layer recomputed from the target's own embeddings
    with torch.no_grad():
        keys, values, _ = tr.translate_batch(bt)
    n = int(rec["tgt_ids"].numel())
    torch.testing.assert_close(values[0, :, :, :n], rec["tgt_v"].float(), atol=2e-3, rtol=2e-3)  # pairs store fp16
    torch.testing.assert_close(keys[0, :, :, :n], rec["tgt_k"].float(), atol=2e-3, rtol=2e-3)
    head = tr.mot.boundary["4"]
    with torch.no_grad():
        head.a.normal_(0, 0.05)
        head.b.normal_(0, 0.05)
    before_target = {k: v.clone() for k, v in tgt.model.state_dict().items()}
    before_other = {k: v.clone() for k, v in tr.mot.state_dict().items() if not k.startswith("boundary.")}
    opt = torch.optim.Adam(list(head.parameters()), lr=1e-2)
    tr.cfg.e2e_accum = 1
    tr.stage_boundary(2, 3, opt)  # replay 2 = boundary layer 4 of 6
    assert tr.replay == 0  # restored after the stage
    assert head.a.grad is not None and float(head.a.grad.abs().sum()) > 0
    for k, v in tgt.model.state_dict().items():
        assert torch.equal(v, before_target[k]), k
    for k, v in tr.mot.state_dict().items():
        if not k.startswith("boundary."):
            assert torch.equal(v, before_other[k]), k


def test_boundary_stage_leaves_no_gradient_outside_its_head(pairs: PairSet) -> None:
    # Stale gradients in the mixture (never cleared by the head's optimiser) used to enter
    # the clipping norm and shrink the head's steps a little more every step.
    tr = _trainer(pairs, boundaries=[4], boundary_rank=4)
    head = tr.mot.boundary["4"]
    with torch.no_grad():
        head.a.normal_(0, 0.05)
    tr.stage_boundary(2, 2, torch.optim.Adam(list(head.parameters()), lr=1e-2))
    for name, p in tr.mot.named_parameters():
        if not name.startswith("boundary.4."):
            assert p.grad is None, name
        assert p.requires_grad, name  # flags restored after the stage


def test_expert_fed_head_starts_as_the_plain_one_and_learns_from_the_expert(pairs: PairSet, tmp_path: Path) -> None:
    from cagkv.translate.artifact import load_translator, save_artifact
    from cagkv.translate.mot import with_expert_fed_heads

    tr = _trainer(pairs, boundaries=[4], boundary_rank=4)
    with torch.no_grad():
        tr.mot.boundary["4"].a.normal_(0, 0.05)
        tr.mot.boundary["4"].b.normal_(0, 0.05)
    plain = tr.mot
    fed = with_expert_fed_heads(plain)
    assert fed.cfg.boundary_from_expert and not plain.cfg.boundary_from_expert
    bt = tr.batch([pairs[0], pairs[1]])
    emb = tr.ts.embed(bt["ids"]).float()
    with torch.no_grad():
        out = fed(bt["src"], emb, bt["mask"])
        torch.testing.assert_close(fed.boundary_hidden(bt["src"], emb, 4, out.hidden),
                                   plain.boundary_hidden(bt["src"], emb, 4))
        with pytest.raises(ValueError, match="hidden state"):
            fed.boundary_hidden(bt["src"], emb, 4)

    tr.mot = fed
    mixture = {k: v.clone() for k, v in fed.state_dict().items() if not k.startswith("boundary.")}
    head = fed.boundary["4"]
    tr.stage_boundary(2, 3, torch.optim.Adam(list(head.parameters()), lr=1e-2))
    assert float(head.h_proj.detach().abs().sum()) > 0  # the read-out of the expert state learned
    for k, v in fed.state_dict().items():
        if k in mixture:
            assert torch.equal(v, mixture[k]), k

    card = {"source": {"fingerprint": tr.source.fingerprint}, "target": {"fingerprint": tr.target.fingerprint}}
    loaded = load_translator(save_artifact(tmp_path / "fed", fed, card, dtype=torch.float32)).model
    assert loaded.cfg.boundary_from_expert
    with torch.no_grad():  # `out` still holds: the stage left the mixture as it was
        torch.testing.assert_close(loaded.boundary_hidden(bt["src"], emb, 4, loaded(bt["src"], emb, bt["mask"]).hidden),
                                   fed.boundary_hidden(bt["src"], emb, 4, out.hidden))


def test_start_from_artifact_equals_it_then_trains_only_the_mixture(pairs: PairSet, tmp_path: Path) -> None:
    import dataclasses

    from cagkv.translate.artifact import save_artifact
    from cagkv.translate.runner import start_from_artifact
    from cagkv.translate.train import freeze_for

    base = _trainer(pairs, skip_rank=8, experts=1, top_k=1, d_model=8, d_expert=8, boundaries=[4], boundary_rank=4)
    base.mot.init_skip_from_ridge(fit_ridge(base, lam=1.0).ridge_w)
    with torch.no_grad():
        base.mot.boundary["4"].a.normal_(0, 0.05)
    card = {"source": {"fingerprint": base.source.fingerprint}, "target": {"fingerprint": base.target.fingerprint},
            "default_replay": 2, "quality": {"value": 0.5}}
    folder = save_artifact(tmp_path / "start", base.mot, card)
    with pytest.raises(Exception, match="source model"):
        start_from_artifact(str(folder), base.target, base.target, base.mot.cfg)

    wider = dataclasses.replace(base.mot.cfg, d_model=16, d_expert=24, experts=3, top_k=2, skip_rank=0, boundaries=[])
    mot, info, start_card = start_from_artifact(str(folder), base.source, base.target, wider)
    assert (mot.cfg.experts, mot.cfg.skip_rank, mot.cfg.boundaries) == (3, 8, [4])  # linear shape from the artifact
    assert info["default_replay"] == 2 and info["tensors_fresh"] > 0 and start_card["default_replay"] == 2
    tr = Trainer(base.source, base.target, pairs, pairs, base.cfg, mot=mot)
    bt = tr.batch([pairs[0], pairs[1]])
    emb = tr.ts.embed(bt["ids"]).float()
    with torch.no_grad():  # the start computes what the artifact computes (stored in float16)
        torch.testing.assert_close(mot(bt["src"], emb, bt["mask"]).y, base.mot(bt["src"], emb, bt["mask"]).y,
                                   atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(mot.boundary_hidden(bt["src"], emb, 4), base.mot.boundary_hidden(bt["src"], emb, 4),
                                   atol=2e-2, rtol=2e-2)

    trainable = freeze_for(mot, "mixture")
    assert 0 < trainable < sum(p.numel() for p in mot.parameters())
    frozen = {k: v.clone() for k, v in mot.state_dict().items() if k.startswith(("skip_", "boundary."))}
    head = mot.head_w.clone()
    tr.stage_e2e(3, make_optimizer(mot, "e2e", tr.cfg))
    assert not torch.equal(mot.head_w, head)  # the mixture learns
    for k, v in mot.state_dict().items():
        if k in frozen:
            assert torch.equal(v, frozen[k]), k


def test_a_mixture_that_cannot_hold_the_artifacts_starts_as_its_linear_path(pairs: PairSet, tmp_path: Path) -> None:
    import dataclasses

    from cagkv.translate.artifact import save_artifact
    from cagkv.translate.runner import start_from_artifact

    base = _trainer(pairs, skip_rank=8, experts=1, top_k=1, d_model=8, d_expert=8)
    base.mot.init_skip_from_ridge(fit_ridge(base, lam=1.0).ridge_w)
    with torch.no_grad():
        base.mot.head_w.normal_(0, 0.5)  # a trained mixture: its output is not zero
    card = {"source": {"fingerprint": base.source.fingerprint}, "target": {"fingerprint": base.target.fingerprint}}
    folder = save_artifact(tmp_path / "start", base.mot, card)
    tr = Trainer(base.source, base.target, pairs, pairs, base.cfg, mot=base.mot)
    bt = tr.batch([pairs[0], pairs[1]])
    emb = tr.ts.embed(bt["ids"]).float()
    x = base.mot.normalise_source(bt["src"])
    for shape in (dict(d_expert=4), dict(d_expert=16)):  # narrower: linear path only; wider: the artifact
        mot, info, _ = start_from_artifact(str(folder), base.source, base.target,
                                           dataclasses.replace(base.mot.cfg, **shape))
        with torch.no_grad():
            y = mot(bt["src"], emb, bt["mask"]).y
            want = mot.skip(x, emb) if shape["d_expert"] < 8 else base.mot(bt["src"], emb, bt["mask"]).y
            assert not torch.allclose(base.mot(bt["src"], emb, bt["mask"]).y, mot.skip(x, emb), atol=1e-2)
        torch.testing.assert_close(y, want, atol=2e-2, rtol=2e-2)
        assert info["starts_as"] == ("linear path" if shape["d_expert"] < 8 else "artifact")


def test_layer_streams_start_as_the_artifact_and_train_alone(pairs, tmp_path) -> None:
    import dataclasses

    from cagkv.translate.artifact import save_artifact
    from cagkv.translate.runner import start_from_artifact
    from cagkv.translate.train import freeze_for

    base = _trainer(pairs, skip_rank=8, experts=1, top_k=1, d_model=8, d_expert=8)
    card = {"source": {"fingerprint": base.source.fingerprint}, "target": {"fingerprint": base.target.fingerprint}}
    folder = save_artifact(tmp_path / "start", base.mot, card)
    layer = base.mot.cfg.translated[-1]
    with pytest.raises(ValueError, match="layer_streams"):
        dataclasses.replace(base.mot.cfg, layer_streams=[0])  # layer 0 is computed exactly, not translated
    with_streams = dataclasses.replace(base.mot.cfg, layer_streams=[layer], stream_d=16)
    mot, info, _ = start_from_artifact(str(folder), base.source, base.target, with_streams)
    assert info["tensors_fresh"] > 0 and str(layer) in mot.streams
    tr = Trainer(base.source, base.target, pairs, pairs, base.cfg, mot=mot)
    bt = tr.batch([pairs[0], pairs[1]])
    emb = tr.ts.embed(bt["ids"]).float()
    with torch.no_grad():  # a zero output projection: the start computes what the artifact computes
        torch.testing.assert_close(mot(bt["src"], emb, bt["mask"]).y, base.mot(bt["src"], emb, bt["mask"]).y,
                                   atol=2e-2, rtol=2e-2)

    with pytest.raises(ValueError, match="needs layer_streams"):
        freeze_for(base.mot, "streams")
    trainable = freeze_for(mot, "streams")
    assert trainable == sum(p.numel() for p in mot.streams.parameters())
    before = {k: v.clone() for k, v in mot.state_dict().items()}
    with torch.no_grad():
        y0 = mot(bt["src"], emb, bt["mask"]).y
    tr.stage_e2e(3, make_optimizer(mot, "e2e", tr.cfg))
    changed = {k for k, v in mot.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("streams.") for k in changed)
    with torch.no_grad():  # only the streamed layer's K/V move
        y1 = mot(bt["src"], emb, bt["mask"]).y
    moved = [(y1[:, i] - y0[:, i]).abs().max().item() > 0 for i in range(y0.shape[1])]
    assert moved == [l == layer for l in mot.cfg.translated]

    from cagkv.translate.artifact import load_translator

    with torch.no_grad():  # a stream that matters, so that losing it on the way to disk would show
        mot.streams[str(layer)].out.weight.normal_(0, 0.5)
        y2 = mot(bt["src"], emb, bt["mask"]).y
    assert (y2 - y1).abs().max() > 0.5
    back = load_translator(save_artifact(tmp_path / "streams", mot, card), base.source.fingerprint,
                           base.target.fingerprint).model
    assert back.cfg.layer_streams == [layer]
    with torch.no_grad():  # saved and loaded with the rest (float16 storage)
        torch.testing.assert_close(back(bt["src"], emb, bt["mask"]).y, y2, atol=5e-2, rtol=2e-2)


def test_key_scales_start_at_one_scale_only_translated_keys_and_train_alone(pairs, tmp_path) -> None:
    import dataclasses

    from cagkv.translate.artifact import load_translator, save_artifact
    from cagkv.translate.runner import start_from_artifact
    from cagkv.translate.train import freeze_for
    from cagkv.translate.translator import assemble_kv

    base = _trainer(pairs, skip_rank=8, experts=1, top_k=1, d_model=8, d_expert=8)
    card = {"source": {"fingerprint": base.source.fingerprint}, "target": {"fingerprint": base.target.fingerprint}}
    folder = save_artifact(tmp_path / "start", base.mot, card)
    mot, info, _ = start_from_artifact(str(folder), base.source, base.target,
                                       dataclasses.replace(base.mot.cfg, key_scale=True))
    assert info["starts_as"] == "artifact" and info["tensors_fresh"] == 1
    tr = Trainer(base.source, base.target, pairs, pairs, base.cfg, mot=mot)
    bt = tr.batch([pairs[0], pairs[1]])
    k_base, v_base, _ = Trainer(base.source, base.target, pairs, pairs, base.cfg, mot=base.mot).translate_batch(bt)
    k0, v0, _ = tr.translate_batch(bt)
    torch.testing.assert_close(k0, k_base, atol=2e-2, rtol=2e-2)  # scales start at 1 (float16 storage aside)

    with pytest.raises(ValueError, match="needs key_scale"):
        freeze_for(base.mot, "key_scale")
    assert freeze_for(mot, "key_scale") == mot.cfg.tgt_layers
    before = {k: v.clone() for k, v in mot.state_dict().items()}
    tr.stage_e2e(3, make_optimizer(mot, "e2e", tr.cfg))
    changed = {k for k, v in mot.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"key_log_scale"}

    with torch.no_grad():  # set known scales: translated layers' keys scale by them after the k-norm
        mot.key_log_scale.copy_(torch.linspace(-0.5, 0.5, mot.cfg.tgt_layers))
        emb = tr.ts.embed(bt["ids"]).float()
        out = mot(bt["src"], emb, bt["mask"])
        k1, v1 = assemble_kv(mot, tr.ts, out, emb)
        mot.key_log_scale.zero_()
        k_one, v_one = assemble_kv(mot, tr.ts, out, emb)
        mot.key_log_scale.copy_(torch.linspace(-0.5, 0.5, mot.cfg.tgt_layers))
    torch.testing.assert_close(v1, v_one)
    for layer in range(mot.cfg.tgt_layers):
        factor = 1.0 if layer in mot.cfg.exact_layers else float(mot.key_scales().detach()[layer])
        torch.testing.assert_close(k1[:, layer], k_one[:, layer] * factor)
    back = load_translator(save_artifact(tmp_path / "scaled", mot, card), base.source.fingerprint,
                           base.target.fingerprint).model
    assert back.cfg.key_scale
    torch.testing.assert_close(back.key_scales(), mot.key_scales(), atol=2e-3, rtol=2e-3)


def test_heldout_documents_do_not_depend_on_the_sample_count() -> None:
    docs = [(f"doc{i}", " ".join(CORPUS[i % 5 : i % 5 + 4])) for i in range(40)]
    few = make_samples(docs, 20, seed=0, chars=(80, 400))
    many = make_samples(docs, 80, seed=0, chars=(80, 400))
    _, held_few = split_by_document(few, 0.2)
    train_many, held_many = split_by_document(many, 0.2)
    held_few_docs = {s.source for s in held_few}
    assert held_few_docs and held_few_docs <= {s.source for s in held_many}
    assert not held_few_docs & {s.source for s in train_many}  # a bigger run never trains on them
    assert 0.05 < len({s.source for s in held_many}) / len({s.source for s in many}) < 0.4


def test_pairs_dir_reuses_an_earlier_runs_pairs_for_the_same_models_only(tmp_path: Path) -> None:
    from cagkv.errors import UsageError
    from cagkv.translate.runner import prepare_pairs

    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    one = [Sample(CORPUS[0], [Continuation("follows", 'In the text, what comes right after "The quick"?', "brown fox")])]
    build_pairs(src, tgt, one * 2, tmp_path / "train", topk=8, predict=5)
    build_pairs(src, tgt, one, tmp_path / "heldout", topk=8, predict=5)
    train, held, data = prepare_pairs(src, tgt, TrainConfig(pairs_dir=str(tmp_path)))
    assert (len(train), len(held)) == (2, 1) and data["pairs_dir"] == str(tmp_path)
    with pytest.raises(UsageError, match="built for source"):
        prepare_pairs(tgt, src, TrainConfig(pairs_dir=str(tmp_path)))
    with pytest.raises(UsageError, match="no train/index.json"):
        prepare_pairs(src, tgt, TrainConfig(pairs_dir=str(tmp_path / "nowhere")))


def test_sample_draw_is_prefix_stable() -> None:
    docs = [(f"doc{i}", " ".join(CORPUS[i % 5 : i % 5 + 4])) for i in range(12)]
    few = make_samples(docs, 7, seed=3, chars=(80, 400))
    many = make_samples(docs, 30, seed=3, chars=(80, 400))
    assert len(many) > len(few) == 7 and many[:7] == few


def test_a_bigger_run_extends_the_pair_folder_a_smaller_one_wrote(tmp_path: Path, monkeypatch) -> None:
    from cagkv.translate import runner

    monkeypatch.setenv("CAGKV_HOME", str(tmp_path / "home"))
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(6):
        (texts / f"d{i}.txt").write_text(" ".join(CORPUS[i % 5 : i % 5 + 4] * 3))
    built = []
    real_build = runner.build_pairs

    def counting_build(source, target, samples, out_dir, **kw):
        before = len(list(Path(out_dir).glob("[0-9]*.safetensors")))
        real_build(source, target, samples, out_dir, **kw)
        built.append(len(list(Path(out_dir).glob("[0-9]*.safetensors"))) - before)

    monkeypatch.setattr(runner, "build_pairs", counting_build)
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    cfg = dict(corpora=[str(texts)], chunk_chars=[80, 200], topk=8, predict=5, heldout_share=0.3)
    tr_few, held_few, d_few = runner.prepare_pairs(src, tgt, TrainConfig(samples=4, **cfg))
    first = list(tr_few.files) + list(held_few.files)
    assert sum(built) == 4
    tr, held, data = runner.prepare_pairs(src, tgt, TrainConfig(samples=9, **cfg))
    assert data["pairs_dir"] == d_few["pairs_dir"] and sum(built) == 9  # only the 5 new samples were built
    assert len(tr) + len(held) == 9 and tr.files[: len(tr_few)] == tr_few.files
    assert held.files[: len(held_few)] == held_few.files
    tr_again, held_again, _ = runner.prepare_pairs(src, tgt, TrainConfig(samples=4, **cfg))
    assert list(tr_again.files) + list(held_again.files) == first and sum(built) == 9  # reads the first files only


def test_key_attention_loss_is_zero_on_native_keys_and_the_e2e_term_lowers_it(pairs: PairSet) -> None:
    rec = next(r for r in pairs if r["kinds"])
    tr = _trainer(pairs, key_weight=100.0, lr_e2e=3e-3, anchor_weight=0.0)
    native = rec["tgt_k"].float()[None]  # [1, L, H, T, D]: what a perfect translation gives
    assert float(tr.key_attention_loss(native, rec, 0, 0)) == pytest.approx(0.0, abs=1e-5)

    def on_translated_keys() -> float:
        with torch.no_grad():
            keys, _, _ = tr.translate_batch(tr.batch([rec]))
            return float(torch.stack([tr.key_attention_loss(keys, rec, 0, j) for j in range(len(rec["kinds"]))]).mean())

    before = on_translated_keys()
    assert before > 1e-4
    tr.stage_e2e(15, make_optimizer(tr.mot, "e2e", tr.cfg))
    assert on_translated_keys() < before * 0.9


def test_key_logit_weights_are_the_query_energy_of_each_rope_pair(pairs: PairSet) -> None:
    tr = _trainer(pairs, key_logit_weight=1.0)
    w = tr.key_logit_weights()
    cfg = tr.mot.cfg
    assert w.shape == (cfg.tgt_layers, cfg.tgt_kv_heads, cfg.tgt_head_dim) and bool((w >= 0).all())
    for l, rope in enumerate(tr.target.spec.rope):
        if rope is not None:
            half = rope.rotary_dim // 2
            assert torch.allclose(w[l, :, :half], w[l, :, half : 2 * half])  # position-free: one weight per pair
    # each KV head's weights hold the mean squared norm of its group's queries (GQA: heads summed)
    qs = [r[f"c{j}_q"].float() for r in pairs for j in range(len(r["kinds"]))]  # [L, Hq, N, D] each
    q = torch.cat(qs, 2)
    per_head = q.pow(2).sum(-1).mean(2)  # [L, Hq]
    expected = per_head.reshape(cfg.tgt_layers, cfg.tgt_kv_heads, -1).sum(-1)
    assert torch.allclose(w.sum(-1), expected, rtol=1e-4)


def test_key_logit_loss_ignores_a_shared_shift_and_the_e2e_term_lowers_it(pairs: PairSet) -> None:
    rec = next(r for r in pairs if r["kinds"])
    tr = _trainer(pairs, key_logit_weight=30.0, lr_e2e=3e-3, anchor_weight=0.0)
    bt = tr.batch([rec])
    native = rec["tgt_k"].float()[None]  # [1, L, H, T, D]
    assert float(tr.key_logit_loss(native, bt)) == pytest.approx(0.0, abs=1e-6)
    shifted = native + torch.randn(1, native.shape[1], native.shape[2], 1, native.shape[4])  # one shift per chunk
    assert float(tr.key_logit_loss(shifted, bt)) == pytest.approx(0.0, abs=1e-5)
    noisy = native + 0.5 * torch.randn_like(native)
    assert float(tr.key_logit_loss(noisy, bt)) > 1e-3

    def on_translated_keys() -> float:
        with torch.no_grad():
            keys, _, _ = tr.translate_batch(tr.batch([rec]))
            return float(tr.key_logit_loss(keys, bt))

    before = on_translated_keys()
    tr.stage_e2e(15, make_optimizer(tr.mot, "e2e", tr.cfg))
    assert on_translated_keys() < before * 0.9
    assert tr.evaluate(limit=1)["key_logit_rel_error"] is not None
