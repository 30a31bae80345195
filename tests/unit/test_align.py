"""Character-overlap alignment between two different tokenizers of the same text."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cagkv.align import align_tokens, spans_from_pieces, token_offsets, token_offsets_many

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Naïve café owners in Zürich sell crème brûlée; 東京 is far away.",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabs and   spaces.",
    "Numbers 12345 and 3.14159, emails a@b.c and URLs http://x.y/z?q=1.",
] * 4


@functools.lru_cache(maxsize=None)
def _tokenizers():
    """A byte-level BPE (SmolLM/Qwen style) and a Metaspace BPE with byte fallback (Gemma style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bl = Tokenizer(models.BPE())
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    sp = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    sp.train_from_iterator(
        _CORPUS[:2],  # a narrow alphabet: most symbols fall back to bytes
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *alphabet], show_progress=False),
    )
    return (
        PreTrainedTokenizerFast(tokenizer_object=bl),
        PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>"),
    )


def _check_weights(w: torch.Tensor, src: torch.Tensor, tgt: torch.Tensor) -> None:
    assert w.shape == (tgt.shape[0], src.shape[0])
    assert bool((w >= 0).all())
    torch.testing.assert_close(w.sum(dim=1), torch.ones(tgt.shape[0]))
    for t in range(tgt.shape[0]):
        ov = (torch.minimum(src[:, 1], tgt[t, 1]) - torch.maximum(src[:, 0], tgt[t, 0])).clamp(min=0).float()
        if ov.sum() > 0:  # weights proportional to shared characters
            torch.testing.assert_close(w[t], ov / ov.sum())
        else:  # exactly one nearest token
            assert int((w[t] > 0).sum()) == 1


def test_identity_for_same_spans() -> None:
    spans = torch.tensor(spans_from_pieces(["Hel", "lo", " ", "wor", "ld"]))
    torch.testing.assert_close(align_tokens(spans, spans), torch.eye(5))


def test_split_and_merge() -> None:
    src = torch.tensor([[0, 2], [2, 4]])  # "ab" "cd"
    tgt = torch.tensor([[0, 1], [1, 4]])  # "a" "bcd"
    w = align_tokens(src, tgt)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0], [1 / 3, 2 / 3]]))


def test_empty_spans_take_nearest() -> None:
    src = torch.tensor([[0, 3], [3, 6], [6, 9]])
    tgt = torch.tensor([[0, 0], [4, 4], [9, 9], [3, 6]])  # special-token style empty spans
    w = align_tokens(src, tgt)
    assert w[0].argmax() == 0 and w[1].argmax() == 1 and w[2].argmax() == 2
    torch.testing.assert_close(w[3], torch.tensor([0.0, 1.0, 0.0]))


def test_gap_in_source_takes_nearest() -> None:
    src = torch.tensor([[0, 2], [6, 8]])  # the source dropped characters 2..6 (whitespace)
    tgt = torch.tensor([[0, 2], [2, 3], [5, 6], [6, 8]])
    w = align_tokens(src, tgt)
    assert w[1].argmax() == 0 and w[2].argmax() == 1


def test_byte_fallback_pieces_share_a_span() -> None:
    _, sp = _tokenizers()
    text = "🎉 ok"
    ids, offs = token_offsets(sp, text)
    pieces = sp.convert_ids_to_tokens(ids.tolist())
    assert sum(p.startswith("<0x") for p in pieces) >= 4  # the emoji became byte pieces
    bl, _ = _tokenizers()
    _, src = token_offsets(bl, text)
    _check_weights(align_tokens(src, offs), src, offs)


def test_unicode_and_whitespace_runs() -> None:
    bl, sp = _tokenizers()
    text = "naïve  café\n\n\t東京   🎉 — fin.  "
    _, src = token_offsets(bl, text)
    _, tgt = token_offsets(sp, text)
    assert int(src.max()) <= len(text) and int(tgt.max()) <= len(text)
    _check_weights(align_tokens(src, tgt), src, tgt)
    _check_weights(align_tokens(tgt, src), tgt, src)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60))
def test_property_two_tokenizers(text: str) -> None:
    bl, sp = _tokenizers()
    _, src = token_offsets(bl, text)
    _, tgt = token_offsets(sp, text)
    if src.shape[0] == 0 or tgt.shape[0] == 0:
        return
    _check_weights(align_tokens(src, tgt), src, tgt)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=20), st.data())
def test_property_pooling_recovers_resegmented_features(pieces: list[str], data: st.DataObject) -> None:
    """A per-character feature pooled through two segmentations keeps its character average."""
    text = "".join(pieces)
    src = torch.tensor(spans_from_pieces(pieces))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=10))) | {0, len(text)})
    tgt = torch.tensor([[a, b] for a, b in zip(cuts, cuts[1:]) if b > a])
    w = align_tokens(src, tgt)
    _check_weights(w, src, tgt)
    # a feature equal to every source token's span length: pooled values are weighted means
    lens = (src[:, 1] - src[:, 0]).float()[:, None]
    pooled = w @ lens
    assert bool((pooled >= lens.min() - 1e-5).all()) and bool((pooled <= lens.max() + 1e-5).all())


def test_empty_source_rejected() -> None:
    with pytest.raises(ValueError, match="empty source"):
        align_tokens(torch.zeros(0, 2, dtype=torch.long), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("text", _CORPUS[:4])
def test_gathered_pooling_equals_the_sparse_product(text: str) -> None:
    """`pool_features(sparse=False)` (what translation runs on a GPU) sums what the CPU's sparse product does."""
    from cagkv.translate.translator import pool_features

    bl, sp = _tokenizers()
    _, src = token_offsets(bl, text)
    _, tgt = token_offsets(sp, text)
    w = align_tokens(src, tgt)
    feats = torch.randn(w.shape[1], 7, generator=torch.Generator().manual_seed(0))
    sparse, gathered = torch.full((w.shape[0], 7), float("nan")), torch.full((w.shape[0], 7), float("nan"))
    pool_features(w, feats, sparse, sparse=True)
    pool_features(w, feats, gathered, sparse=False)
    torch.testing.assert_close(gathered, sparse)
    torch.testing.assert_close(sparse, w @ feats)


def test_batched_token_offsets_equal_one_by_one() -> None:
    bl, sp = _tokenizers()
    texts = [*_CORPUS[:4], "  leading and trailing  ", "x"]
    for tok in (bl, sp):
        got = token_offsets_many(tok, texts)
        assert len(got) == len(texts)
        for (ids, offs), text in zip(got, texts):
            want_ids, want_offs = token_offsets(tok, text)
            assert torch.equal(ids, want_ids) and torch.equal(offs, want_offs)
    assert token_offsets_many(bl, []) == []
