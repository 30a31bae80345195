"""The shipped translators (smollm2-135m -> gemma3-270m, smollm2-135m -> qwen2.5-0.5b,
gemma3-270m -> smollm2-135m) on the real models.

Skips when a model is not pulled or no translator for the pair is installed
(`cagkv train --canonical SOURCE --target TARGET`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cagkv.align import token_offsets
from cagkv.errors import TranslatorError
from cagkv.kv import KVBlock
from cagkv.models import build_cache, extract_kv, full_cache
from cagkv.prompt import PromptFormat
from cagkv.refresh import NEEDS_DIFFICULTY
from cagkv.translate import find_translator, load_translator

pytestmark = pytest.mark.integration

DOC = ("Marie Curie was born in Warsaw in 1867. She moved to Paris in 1891 to study physics at "
       "the Sorbonne, where she met Pierre Curie, whom she married in 1895.")
OTHER = ("The Great Barrier Reef lies off the coast of Queensland. It is the largest coral reef "
         "system in the world and can be seen from space.")
QUESTION, ANSWER = "In which city was Marie Curie born?", " Warsaw"


PAIRS = (("smollm2-135m", "gemma3-270m"), ("smollm2-135m", "qwen2.5-0.5b"), ("gemma3-270m", "smollm2-135m"))
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")


@pytest.fixture(scope="module", params=PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def pair(request, real_model):
    source, target = request.param
    src, tgt = real_model(source), real_model(target)
    tr = find_translator(src.fingerprint, tgt.fingerprint)
    if tr is None:
        pytest.skip(f"no {source} -> {target} translator installed: run `cagkv train ...`")
    return src, tgt, tr


def _block(loaded, text: str) -> KVBlock:
    fmt = PromptFormat.for_model(loaded)
    prefix = fmt.context_prefix_ids()
    ids, offs = token_offsets(loaded.tokenizer, text)
    with torch.no_grad():
        out = loaded.model(input_ids=torch.tensor([prefix + ids.tolist()]), cache=full_cache(), use_cache=True)
    k, v = extract_kv(out.cache, loaded.spec, torch.arange(len(prefix), len(prefix) + ids.numel()))
    return KVBlock(k, v, ids, offs, text, loaded.fingerprint)


def _answer_ll(tgt, block: KVBlock | None) -> float:
    """Mean log-prob of ANSWER after prefix + block + separator + question (None: no document)."""
    fmt = PromptFormat.for_model(tgt)
    prefix = fmt.context_prefix_ids()
    pk, pv = _block_prefix(tgt, prefix)
    cont = (fmt.separator_ids() if block is not None else []) + fmt.question_suffix_ids(QUESTION)
    ans = fmt.encode(ANSWER)
    if block is None:
        k, v, n = pk, pv, len(prefix)
    else:
        k, v = torch.cat([pk, block.keys], 2), torch.cat([pv, block.values], 2)
        n = len(prefix) + block.num_tokens
    cache = build_cache(tgt.config, tgt.spec, k, v, torch.arange(n))
    with torch.no_grad():
        logits = tgt.model(input_ids=torch.tensor([cont + ans]), cache=cache).logits[0]
    logp = F.log_softmax(logits[len(cont) - 1 : -1].float(), -1)
    return float(logp.gather(1, torch.tensor(ans)[:, None]).mean())


def _block_prefix(tgt, prefix):
    with torch.no_grad():
        out = tgt.model(input_ids=torch.tensor([prefix]), cache=full_cache(), use_cache=True)
    return extract_kv(out.cache, tgt.spec, torch.arange(len(prefix)))


def test_card_and_size(pair) -> None:
    src, tgt, tr = pair
    card = tr.card
    assert card["source"]["fingerprint"] == src.fingerprint and card["target"]["fingerprint"] == tgt.fingerprint
    assert card["size_bytes"] <= 36 * 2**20  # largest shipped: gemma3-270m -> smollm2-135m, 34.7 MB
    for key in ("layer_map", "metrics", "stages", "data", "quality"):
        assert key in card
    assert isinstance(tr.good_enough(), tuple)


def test_a_card_naming_a_difficulty_scoring_ships_its_table(pair) -> None:
    src, tgt, tr = pair
    named = tr.card.get("default_refresh_scoring")
    if named is None:
        assert tr.default_refresh_scoring == "contrast"
        return
    assert tr.default_refresh_scoring == named  # not the fallback a missing table would give
    if named in NEEDS_DIFFICULTY:
        assert "difficulty" in tr.card and tr.difficulty is not None


def test_a_shipped_table_is_the_one_its_card_describes(pair) -> None:
    src, tgt, tr = pair
    record = tr.card.get("difficulty")
    if record is None:
        assert tr.difficulty is None
        return
    table = tr.difficulty
    assert table is not None and table.numel() == tgt.config.vocab_size
    # ids never seen sit at the prior; the seen ones span the card's range (rounded to 3 places)
    assert int((table != table.mode().values).sum()) <= record["ids_seen"]
    low, high = record["range_seen"]
    assert abs(float(table.min()) - low) < 1e-3 and abs(float(table.max()) - high) < 1e-3
    assert float(table.max()) > 1.0 > float(table.min())
    # adaptive's switch: the card's own tuned threshold where it names one (E77)
    from cagkv.refresh import PEAK_Z

    assert tr.peak_z == float(record.get("peak_z", PEAK_Z))


def test_translate_shapes_and_exact_layer0(pair) -> None:
    src, tgt, tr = pair
    out = tr.translate(_block(src, DOC), tgt)
    native = _block(tgt, DOC)
    spec = tgt.spec
    assert out.keys.shape == native.keys.shape == (spec.num_layers, spec.num_kv_heads, native.num_tokens, spec.head_dim)
    assert torch.equal(out.token_ids, native.token_ids)
    torch.testing.assert_close(out.keys[0], native.keys[0], rtol=1e-3, atol=1e-3)
    assert bool(torch.isfinite(out.keys).all() and torch.isfinite(out.values).all())


def test_translation_is_document_specific(pair) -> None:
    """The answer is likelier from the right document's translation than from a wrong one's."""
    src, tgt, tr = pair
    right = _answer_ll(tgt, tr.translate(_block(src, DOC), tgt))
    wrong = _answer_ll(tgt, tr.translate(_block(src, OTHER), tgt))
    native = _answer_ll(tgt, _block(tgt, DOC))
    print(f"answer log-prob: native {native:.3f}, translated {right:.3f}, wrong document {wrong:.3f}")
    assert native > wrong
    assert right > wrong


def test_replay_and_window_on_the_real_pair(pair) -> None:
    """replay = L is the target's own prefill of the chunk; every shipped replay head and
    mot-window give finite K/V that keep the answer document-specific."""
    src, tgt, tr = pair
    block, native = _block(src, DOC), _block(tgt, DOC)
    full = tr.translate(block, tgt, replay=tgt.spec.num_layers)
    torch.testing.assert_close(full.keys, native.keys, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(full.values, native.values, rtol=1e-4, atol=1e-4)
    wrong = _answer_ll(tgt, tr.translate(_block(src, OTHER), tgt))
    for r in [v for v in tr.replay_values if 0 < v < tgt.spec.num_layers]:
        out = tr.translate(block, tgt, replay=r)
        assert bool(torch.isfinite(out.keys).all() and torch.isfinite(out.values).all())
        assert _answer_ll(tgt, out) > wrong, f"replay {r}"
    window = tr.translate(block, tgt, window=True)
    assert _answer_ll(tgt, window) > wrong


def test_fingerprint_mismatch_refused(pair, real_model) -> None:
    src, tgt, tr = pair
    other = real_model(next(m for m in MODELS if m not in (src.name, tgt.name)))
    path = tr.path
    with pytest.raises(TranslatorError, match="target model"):
        tr.translate(_block(src, DOC), other)
    if path:
        with pytest.raises(TranslatorError):
            load_translator(path, src.fingerprint, other.fingerprint)
