"""Question-time refresh (cagkv.refresh): recomputed tokens get exactly the target's own K/V."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_lms import tiny

from cagkv.models.cache import full_cache
from cagkv.refresh import (contrast, draft_answer, feed, pool, prompt_attention, question_attention,
                           peakedness, refresh_tokens, shift_translated, top_positions, union_rank)


def _native(model, ids: torch.Tensor, cache_factory=full_cache):
    with torch.no_grad():
        cache = cache_factory()
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _corrupt(cache, positions: list[int]) -> None:
    """Random K/V at `positions` on every layer (what a bad translation would leave)."""
    g = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        for p in positions:
            layer.keys[:, :, p] = torch.randn(layer.keys[:, :, p].shape, generator=g)
            layer.values[:, :, p] = torch.randn(layer.values[:, :, p].shape, generator=g)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("positions", [[3, 4, 9, 15], list(range(2, 20))])
def test_refreshing_corrupted_tokens_gives_back_the_native_cache(family: str, positions: list[int]) -> None:
    # 20 tokens: longer than Gemma-3's tiny sliding window (8), so the window masks are exercised
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(0))
    native = _native(lm.model, ids)
    cache = copy.deepcopy(native)
    _corrupt(cache, positions)
    assert not torch.allclose(cache.layers[0].keys, native.layers[0].keys)
    refresh_tokens(lm.model, cache, ids[0, positions].tolist(), positions)
    for got, want in zip(cache.layers, native.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_shift_translated_removes_a_blocks_shared_offset_measured_on_its_refreshed_tokens(family: str) -> None:
    """A block translated with one offset per layer and head (keys offset before RoPE) gets the
    native cache back on its other tokens once its refreshed tokens show the offset; a block
    with too few refreshed tokens, and the tokens outside every block, are left alone."""
    from cagkv.models.rope import rotate
    from cagkv.models.spec import ModelSpec

    lm = tiny(family)
    ropes = ModelSpec.from_config(lm.model.config).rope
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    native = _native(lm.model, ids)
    blocks = [(2, 12), (15, 8)]  # positions 0-1 and 14: prefix and separator, never translated
    translated = copy.deepcopy(native)
    g = torch.Generator().manual_seed(3)
    for layer, rope in zip(translated.layers, ropes):
        for start, count in blocks:
            at = torch.arange(start, start + count)
            dk = torch.randn(*layer.keys.shape[:2], 1, layer.keys.shape[-1], generator=g)
            dv = torch.randn(*layer.values.shape[:2], 1, layer.values.shape[-1], generator=g)
            layer.keys[:, :, at] -= rotate(dk.expand(-1, -1, count, -1), at, rope)
            layer.values[:, :, at] -= dv
    chosen = [3, 5, 6, 9, 11, 16]  # four in the first block, two in the second
    stale = [(layer.keys[:, :, chosen].clone(), layer.values[:, :, chosen].clone()) for layer in translated.layers]
    cache = copy.deepcopy(translated)
    for layer, want in zip(cache.layers, native.layers):  # what refresh_tokens would give them, idealised
        layer.keys[:, :, chosen] = want.keys[:, :, chosen]
        layer.values[:, :, chosen] = want.values[:, :, chosen]
    shift_translated(cache, ropes, blocks, chosen, stale, min_tokens=3)
    first, second, outside = list(range(2, 14)), list(range(15, 23)), [0, 1, 14, 23]
    for got, want, was in zip(cache.layers, native.layers, translated.layers):
        torch.testing.assert_close(got.keys[:, :, first], want.keys[:, :, first], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values[:, :, first], want.values[:, :, first], atol=1e-5, rtol=1e-5)
        rest = [p for p in second if p != 16]
        assert torch.equal(got.keys[:, :, rest], was.keys[:, :, rest])  # 2 refreshed < min_tokens
        assert torch.equal(got.values[:, :, outside], was.values[:, :, outside])
        assert torch.equal(got.keys[:, :, outside], was.keys[:, :, outside])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_feed_recomputes_stale_entries_in_the_prompts_forward(family: str) -> None:
    # 20 cached tokens, 6 of them corrupted, then a 5-token prompt: one forward must give the
    # logits and cache of refreshing first and feeding the prompt after (Gemma-3: window 8)
    from transformers import DynamicCache

    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 25), generator=torch.Generator().manual_seed(3))
    native = _native(lm.model, ids[:, :20])
    stale = {p: int(ids[0, p]) for p in (0, 3, 4, 9, 15, 19)}
    cache = copy.deepcopy(native)
    _corrupt(cache, sorted(stale))
    before = [layer.keys.clone() for layer in cache.layers]
    prompt = ids[0, 20:].tolist()
    got_cache, got = feed(lm.model, cache, 20, prompt, stale, keep=0)
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, cache.layers))  # left as it was
    with torch.no_grad():
        want_cache = DynamicCache(config=lm.config)
        want = lm.model(input_ids=ids, cache=want_cache, use_cache=True).logits[0, 20:]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(got_cache.layers, want_cache.layers):
        assert mine.keys.shape == theirs.keys.shape and mine.get_seq_length() == theirs.get_seq_length() == 25
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    # the last logits only, and decoding goes on from the returned cache as from the model's own
    _, last = feed(lm.model, copy.deepcopy(cache), 20, prompt, stale)
    torch.testing.assert_close(last, want[-1:], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        step = lm.model(input_ids=torch.tensor([[7]]), cache=got_cache, position_ids=torch.tensor([[25]]),
                        use_cache=True).logits[0, -1]
        again = lm.model(input_ids=torch.cat([ids, torch.tensor([[7]])], dim=1)).logits[0, -1]
    torch.testing.assert_close(step, again, atol=1e-4, rtol=1e-4)


def test_feed_without_stale_entries_is_the_models_forward_and_checks_its_input() -> None:
    lm = tiny("llama")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = _native(lm.model, ids[:, :8])
    _, got = feed(lm.model, cache, 8, ids[0, 8:].tolist(), {}, keep=0)
    with torch.no_grad():
        want = lm.model(input_ids=ids).logits[0, 8:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no tokens"):
        feed(lm.model, cache, 12, [], {3: 5})
    with pytest.raises(ValueError, match="feeding at position 10"):
        feed(lm.model, _native(lm.model, ids[:, :8]), 10, [5], {3: 5})


def test_refresh_refuses_a_trimmed_sliding_window_cache() -> None:
    # the model's own cache keeps only a sliding layer's window: a token's recomputation would
    # need keys it has dropped, so the refresh says how to keep them instead of going wrong
    from transformers import DynamicCache

    lm = tiny("gemma3_text")
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(2))
    native = _native(lm.model, ids, lambda: DynamicCache(config=lm.config))
    assert native.layers[0].keys.shape[2] < 20
    with pytest.raises(ValueError, match="full_cache"):
        refresh_tokens(lm.model, native, [int(ids[0, 17])], [17])


def test_refresh_rejects_bad_positions() -> None:
    lm = tiny("llama")
    cache = _native(lm.model, torch.randint(3, 90, (1, 10)))
    with pytest.raises(ValueError, match="increasing"):
        refresh_tokens(lm.model, cache, [5, 6], [4, 2])
    with pytest.raises(ValueError, match="not in the cache"):
        refresh_tokens(lm.model, cache, [5], [10])
    with pytest.raises(ValueError, match="2 tokens for 1"):
        refresh_tokens(lm.model, cache, [5, 6], [3])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_question_attention_is_the_mass_the_prompt_puts_on_each_cached_token(family: str) -> None:
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = _native(lm.model, ids)
    before = lm.model.config._attn_implementation
    prompt = [11, 12, 13]
    mass = question_attention(lm.model, cache, 12, prompt)
    assert lm.model.config._attn_implementation == before  # restored
    assert cache.layers[0].keys.shape[2] == 12  # the pass ran on a copy
    # the same mass from one eager forward over context + prompt (Gemma-3's sliding layers mask by window)
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = lm.model(input_ids=torch.cat([ids, torch.tensor([prompt])], 1), output_attentions=True)
    finally:
        lm.model.set_attn_implementation(before)
    want = sum(a[0, :, 12:, :12].sum(dim=(0, 1)) for a in out.attentions)
    torch.testing.assert_close(mass, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_prompts_of_different_lengths_in_one_pass_get_their_own_mass(family: str) -> None:
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = _native(lm.model, ids)
    prompts = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33]]
    batched = prompt_attention(lm.model, cache, 12, prompts)  # right-padded to 5 tokens
    assert batched.shape == (3, 12) and cache.layers[0].keys.shape[:3] == (1, cache.layers[0].keys.shape[1], 12)
    for row, prompt in zip(batched, prompts):
        torch.testing.assert_close(row, question_attention(lm.model, cache, 12, prompt), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no prompt"):
        prompt_attention(lm.model, cache, 12, [[1], []])


def test_top_positions_picks_the_most_attended_candidates() -> None:
    mass = torch.tensor([9.0, 0.1, 5.0, 0.2, 3.0, 4.0])
    assert top_positions(mass, [1, 2, 3, 4, 5], 0.4) == [2, 5]
    assert top_positions(mass, [1, 3], 0.1) == [3]  # at least one
    assert top_positions(mass, [], 0.5) == []
    with pytest.raises(ValueError):
        top_positions(mass, [1], 0)


def test_contrast_ranks_what_the_question_reads_beyond_the_baseline() -> None:
    mass = torch.tensor([50.0, 8.0, 6.0, 1.0, 2.0])
    baseline = torch.tensor([50.0, 8.0, 1.0, 1.0, 0.0])  # position 0: a sink every prompt reads
    score = contrast(mass, baseline, [0, 1, 2, 3, 4])
    assert top_positions(mass, [0, 1, 2, 3, 4], 0.4) == [0, 1]
    assert top_positions(score, [0, 1, 2, 3, 4], 0.4) == [2, 4]
    assert torch.allclose(contrast(baseline, baseline, [0, 1, 2]), torch.ones(5))  # nothing question-specific


def test_pool_averages_neighbours_within_runs_of_consecutive_positions() -> None:
    score = torch.tensor([9.0, 0.0, 0.0, 6.0, 0.0, 0.0, 0.0, 3.0, 3.0, 7.0])
    candidates = [1, 2, 3, 4, 5, 7, 8]  # runs [1..5] and [7, 8]; 0, 6 and 9 are not candidates
    pooled = pool(score, candidates, width=3)
    assert torch.allclose(pooled, torch.tensor([9.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 3.0, 3.0, 7.0]))
    # a lone peak spreads to its neighbours: top-3 becomes the span around it, not three scattered tokens
    spiky = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 1.2])
    everything = list(range(10))
    assert top_positions(spiky, everything, 0.3) == [1, 5, 9]
    assert top_positions(pool(spiky, everything, width=3), everything, 0.3) == [4, 5, 6]
    assert torch.equal(pool(spiky, everything, width=1), spiky)
    with pytest.raises(ValueError, match="odd"):
        pool(spiky, everything, width=4)


def test_score_positions_combines_the_prompts_masses_by_scoring(monkeypatch) -> None:
    import cagkv.refresh as refresh

    masses = torch.tensor([[4.0, 6.0, 2.0, 8.0], [4.0, 2.0, 2.0, 8.0], [4.0, 6.0, 0.0, 0.0]])
    seen = []

    def attention(model, cache, n, prompts):
        seen.append(len(prompts))
        return masses[: len(prompts)]

    monkeypatch.setattr(refresh, "prompt_attention", attention)
    candidates = [1, 2, 3]
    neutral = [[7], [8]]
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "attention"), masses[0])
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "contrast"),
                       contrast(masses[0], masses[1], candidates))
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "averaged"),
                       contrast(masses[0], masses[1:].mean(0), candidates))
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "pooled"),
                       pool(contrast(masses[0], masses[1], candidates), candidates))
    assert seen == [1, 2, 3, 2]
    # the average sees what one neutral prompt misses: position 3 is read by the first neutral prompt only
    assert top_positions(refresh.score_positions(None, None, 4, [5], neutral, candidates, "contrast"), candidates, 0.34) == [1]
    assert top_positions(refresh.score_positions(None, None, 4, [5], neutral, candidates, "averaged"), candidates, 0.34) == [3]
    # drafted: the question and its draft in one row, scaled to the question's length (1 of 3 ids)
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "drafted", [6, 7]),
                       contrast(masses[0] / 3, masses[1], candidates))
    assert seen[-1] == 2
    # the difficulty scorings: the table alone (no pass at all), or contrast weighted by it
    expected = torch.tensor([1.0, 0.5, 3.0, 1.0])
    passes = len(seen)
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "difficulty", (), expected),
                       expected)
    assert len(seen) == passes
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "contrast_difficulty", (),
                                               expected),
                       contrast(masses[0], masses[1], candidates) * expected)
    question = contrast(masses[0], masses[1], candidates)
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "union", (), expected),
                       union_rank(question, question * expected, candidates))
    # adaptive: contrast when it is peaked (here position 1 over an exactly flat body), else the product
    assert refresh.peakedness(question, candidates) == float("inf")
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "adaptive", (), expected),
                       question)
    monkeypatch.setattr(refresh, "peakedness", lambda score, among: refresh.PEAK_Z - 1)
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "adaptive", (), expected),
                       question * expected)
    # a translator's own threshold (its card's, Translator.peak_z) moves the switch
    assert torch.equal(refresh.score_positions(None, None, 4, [5], neutral, candidates, "adaptive", (), expected,
                                               peak_z=refresh.PEAK_Z - 1), question)
    for bad in (None, torch.ones(3)):
        with pytest.raises(ValueError, match="expected error"):
            refresh.score_positions(None, None, 4, [5], neutral, candidates, "difficulty", (), bad)
    with pytest.raises(ValueError, match="neutral"):
        refresh.score_positions(None, None, 4, [5], [], candidates, "contrast")
    with pytest.raises(ValueError, match="unknown"):
        refresh.score_positions(None, None, 4, [5], neutral, candidates, "loud")


def test_prompt_attention_from_two_threads_on_one_model(monkeypatch) -> None:
    """The interleaving that breaks an unguarded switch, forced: thread A is mid-pass when B
    switches to eager (B remembers "eager" as the setting to restore); A finishes and restores
    sdpa; only then does B run its pass. Unguarded, B's pass gets no attention weights and
    leaves the model on eager for good; with the lock B waits for A."""
    import threading

    import cagkv.refresh as refresh

    lm = tiny("llama")
    lm.model.set_attn_implementation("sdpa")  # what real models load with
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = _native(lm.model, ids)
    before = lm.model.config._attn_implementation
    want = prompt_attention(lm.model, cache, 12, [[11, 12, 13]])
    a_in_pass, b_switched, calls = threading.Event(), threading.Event(), []
    real_decoder_of = refresh.decoder_of

    def slow_decoder_of(model):
        decoder = real_decoder_of(model)

        def run(**kwargs):
            calls.append(threading.current_thread().name)
            if len(calls) == 1:  # A: let B reach its switch (it cannot while A holds the lock)
                a_in_pass.set()
                b_switched.wait(timeout=0.5)
            else:  # B: run only after A has had time to finish and restore its setting
                b_switched.set()
                threading.Event().wait(0.5)
            return decoder(**kwargs)

        return run

    monkeypatch.setattr(refresh, "decoder_of", slow_decoder_of)
    results, errors = {}, []

    def worker(name: str) -> None:
        try:
            if name == "B":
                a_in_pass.wait(timeout=5)
            results[name] = prompt_attention(lm.model, cache, 12, [[11, 12, 13]])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,), name=n) for n in ("A", "B")]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join()
    assert not errors and calls == ["A", "B"]
    for mass in results.values():
        torch.testing.assert_close(mass, want)
    assert lm.model.config._attn_implementation == before


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_draft_answer_is_the_greedy_continuation_and_leaves_the_cache(family: str) -> None:
    lm = tiny(family)
    ids = torch.randint(3, 90, (1, 14), generator=torch.Generator().manual_seed(3))
    cache = _native(lm.model, ids[:, :10])
    before = copy.deepcopy(cache)
    drafted = draft_answer(lm.model, cache, 10, ids[0, 10:].tolist(), count=5)
    with torch.no_grad():
        whole = lm.model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert drafted == whole[0, 14:].tolist()
    for got, want in zip(cache.layers, before.layers):
        assert torch.equal(got.keys, want.keys) and got.keys.shape == want.keys.shape
    # a stop id ends the draft before it
    assert draft_answer(lm.model, cache, 10, ids[0, 10:].tolist(), count=5, stop_ids=[drafted[2]]) == drafted[:2]


def test_peakedness_is_the_robust_z_of_the_best_candidate() -> None:
    score = torch.tensor([100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 20.0])
    candidates = [1, 2, 3, 4, 5, 6]  # position 0 is not a candidate: its 100 does not count
    # medians are the lower middle value (torch's): median 3, deviations 2 1 0 1 2 17 -> MAD 1
    assert peakedness(score, candidates) == pytest.approx(17.0)
    assert peakedness(score, [1, 2, 3, 4, 5]) == pytest.approx(2.0)  # no outlier: (5 - 3) / 1
    assert peakedness(torch.ones(5), [0, 1, 2, 3]) == 0.0  # flat, nothing stands out
    assert peakedness(score, [6]) == 0.0


def test_union_rank_takes_the_top_of_both_lists_at_the_same_depth() -> None:
    candidates = [1, 2, 3, 4, 5, 6, 7, 8]
    first = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0])   # ranks 1 > 2 > ... > 8
    second = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])  # the reverse
    score = union_rank(first, second, candidates)
    assert float(score[0]) == 0.0  # not a candidate
    # a quarter (2 tokens): the first of each list; a half: the top two of each
    assert top_positions(score, candidates, 0.25) == [1, 8]
    assert top_positions(score, candidates, 0.5) == [1, 2, 7, 8]
    # lists that agree give that list's order; a tie between the lists goes to the first
    assert top_positions(union_rank(first, first, candidates), candidates, 0.375) == [1, 2, 3]
    assert top_positions(score, candidates, 1 / 8) == [1]
    assert torch.equal(union_rank(first, second, []), torch.zeros(9))
