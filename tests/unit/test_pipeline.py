"""The engine on tiny random models and temporary stores: ingest -> ask in every mode.

The central check: in `canonical` mode the assembled cache (native prefix + stored
position-free block re-rotated + native separator) equals a native prefill of the same
ids, so greedy answers are the identical tokens and next-token logits agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import make_model_dir

from cagkv.errors import StoreError, TranslatorError, UsageError
from cagkv.ingest import collect_sources, ingest, ingest_sources, ingest_text
from cagkv.kv import KVBlock
from cagkv.pipeline import CAG, NEUTRAL_QUESTIONS, TIMING_KEYS
from cagkv.prefill import prefill_chunks
from cagkv.prompt import PromptFormat

DOC_A = (
    "The lighthouse keeper lived on the island for thirty years. Every night he lit the lamp "
    "at sunset. Ships passed safely because of the light."
)
DOC_B = "Paris is the capital of France. It is known for the Eiffel Tower. The river is the Seine."


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("cagkv_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAGKV_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def models(home):
    return {
        "llama": str(make_model_dir(home / "m", "llama", chat=True)),
        "qwen2": str(make_model_dir(home / "m", "qwen2", chat=True)),
        "gemma": str(make_model_dir(home / "m", "gemma3_text", chat=False)),
    }


def make_store(tmp_path, canonical, docs, chunk_tokens=256):
    for i, text in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(text)
    report = ingest([str(tmp_path / f"doc{i}.txt") for i in range(len(docs))], tmp_path / "store",
                    canonical=canonical, chunk_tokens=chunk_tokens, dtype="float32",
                    embedder="hash-64", progress=False)  # fmt: skip
    return report, CAG.open(str(tmp_path / "store"))


def native_logits(cag, target, chunk_texts, question):
    """Next-token logits after a plain prefill of prefix + chunks + suffix."""
    loaded = cag.model(target)
    ids = PromptFormat.for_model(loaded).prompt_ids(chunk_texts, question)
    with torch.no_grad():
        return loaded.model(input_ids=torch.tensor([ids])).logits[0, -1]


def prepared_logits(cag, prepared):
    with torch.no_grad():
        out = prepared.target.model(
            input_ids=torch.tensor([prepared.prompt_ids]),
            cache=prepared.cache,
            position_ids=torch.arange(prepared.next_position, prepared.next_position + len(prepared.prompt_ids))[None],
        )
    return out.logits[0, -1]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_canonical_equals_native_prefill_for_one_chunk(tmp_path, models, family):
    doc = DOC_A if family == "llama" else DOC_A + " " + DOC_B  # gemma: longer than its 8-token window
    report, cag = make_store(tmp_path, models[family], [doc])
    assert report.documents == 1 and report.chunks == 1
    q = "How long did the keeper live there?"
    canon = cag.ask(q, mode="canonical", max_new_tokens=12)
    native = cag.ask(q, mode="native", max_new_tokens=12)
    assert canon.mode == "canonical" and native.mode == "native"
    assert len(canon.token_ids) >= 3  # a real answer, not an immediate stop
    assert canon.token_ids == native.token_ids and canon.text == native.text
    assert canon.tokens == native.tokens
    # the assembled cache is the native one: the next-token logits agree
    prepared = cag.prepare(q, mode="canonical")
    assert prepared.context_tokens == canon.tokens["context"] > 20
    torch.testing.assert_close(prepared_logits(cag, prepared), native_logits(cag, models[family], [doc], q),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_engine_device_is_parsed_and_models_load_there(tmp_path, models, monkeypatch):
    from cagkv.models import load
    from cagkv.models.loading import parse_device

    _, cag = make_store(tmp_path, models["llama"], [DOC_A])
    assert cag.device == torch.device("cpu") and cag.model(models["llama"]).device == torch.device("cpu")
    assert CAG.open(str(tmp_path / "store"), device="cpu").model(models["llama"]) is load(models["llama"], device="cpu")
    assert parse_device(None) == parse_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_device("auto") == torch.device("cpu")
    for bad, why in (("cuda", "no CUDA GPU"), ("cuda:0", "no CUDA GPU"), ("tpu", "unknown device"), ("meta", "cpu or cuda")):
        with pytest.raises(UsageError, match=why):
            CAG.open(str(tmp_path / "store"), device=bad)


def test_ingest_device_is_checked_before_anything_is_written(tmp_path, models, monkeypatch):
    from cagkv.ingest import parse_dtype

    (tmp_path / "doc.txt").write_text(DOC_A)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for bad, why in (("cuda", "no CUDA GPU"), ("tpu", "unknown device")):
        with pytest.raises(UsageError, match=why):
            ingest([str(tmp_path / "doc.txt")], tmp_path / "store", canonical=models["llama"], progress=False, device=bad)
    assert not (tmp_path / "store").exists()
    report = ingest([str(tmp_path / "doc.txt")], tmp_path / "store", canonical=models["llama"], dtype="float32",
                    embedder="hash-64", progress=False, device="auto")  # no GPU: the CPU
    assert report.documents == 1
    # "auto" is bfloat16 on a GPU whatever the host CPU computes natively
    assert parse_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert parse_dtype("auto", torch.device("cpu")) == parse_dtype("auto")
    assert parse_dtype("float32", torch.device("cuda")) == torch.float32


def test_multi_chunk_assembly_matches_independent_prefill(tmp_path, models):
    # Two chunks prefilled independently: equal to a native prefill where chunk 2 cannot see chunk 1.
    report, cag = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    assert report.documents == 2 and report.chunks >= 4
    answer = cag.ask("What is the capital of France?", mode="canonical", top_k=3, max_new_tokens=4)
    assert len(answer.sources) == 3
    assert len({s.chunk for s in answer.sources}) == 3
    loaded = cag.model(models["llama"])
    fmt = PromptFormat.for_model(loaded)
    sep = fmt.separator_ids()
    expected = sum(len(fmt.chunk_ids(s.text)) + len(sep) for s in answer.sources)
    assert answer.tokens["context"] == expected
    assert answer.tokens["prompt"] == len(fmt.prompt_ids([s.text for s in answer.sources], "What is the capital of France?"))
    native = cag.ask("What is the capital of France?", mode="native", top_k=3, max_new_tokens=4)
    assert native.tokens == answer.tokens and [s.chunk for s in native.sources] == [s.chunk for s in answer.sources]


def test_none_mode_and_timings(tmp_path, models):
    _, cag = make_store(tmp_path, models["llama"], [DOC_A])
    answer = cag.ask("Who lit the lamp?", mode="none", max_new_tokens=5)
    assert answer.mode == "none" and answer.sources == [] and answer.tokens["context"] == 0
    full = cag.ask("Who lit the lamp?", mode="auto", max_new_tokens=5)
    assert full.mode == "canonical" and "canonical" in full.mode_reason
    assert set(full.timings_ms) == set(TIMING_KEYS)
    assert all(v >= 0 for v in full.timings_ms.values())
    assert full.timings_ms["retrieve"] > 0 and full.timings_ms["load"] > 0 and full.timings_ms["prefill"] > 0
    assert full.timings_ms["first_token"] <= full.timings_ms["total"]
    d = full.to_dict()
    assert set(d) == {"answer", "target", "mode", "sources", "timings_ms"}
    assert set(d["sources"][0]) == {"document", "chunk", "score"}


def test_auto_uses_native_for_another_target_and_says_so(tmp_path, models):
    _, cag = make_store(tmp_path, models["llama"], [DOC_A])
    answer = cag.ask("Who lit the lamp?", target=models["qwen2"], max_new_tokens=6)
    assert answer.mode == "native" and "no translator" in answer.mode_reason
    assert answer.target == "qwen2-chat-0"
    with pytest.raises(TranslatorError, match="no translator"):
        cag.ask("Who lit the lamp?", target=models["qwen2"], mode="translate")
    with pytest.raises(UsageError, match="canonical"):
        cag.ask("Who lit the lamp?", target=models["qwen2"], mode="canonical")


class PrefillTranslator:
    """A perfect 'translator': the target's own prefill of the block text (after its prefix).

    with_separator=False returns the chunk text's tokens only, like the trained translator,
    so the engine computes the separator itself.
    """

    def __init__(self, ok=True, with_separator=True):
        self.ok, self.calls, self.with_separator = ok, 0, with_separator

    def good_enough(self):
        return self.ok, "test card"

    def translate(self, block, target):
        self.calls += 1
        out = prefill_chunks(target, [block.text])[0]
        if self.with_separator:
            return out
        t = out.num_tokens - int(out.extra["separator_tokens"])
        return KVBlock(out.keys[:, :, :t], out.values[:, :, :t], out.token_ids[:t], out.offsets[:t], out.text,
                       out.model_fingerprint)  # fmt: skip


@pytest.mark.parametrize("target,with_separator", [("qwen2", True), ("qwen2", False), ("gemma", False)])
def test_translate_hook_with_a_perfect_translator_equals_native(tmp_path, models, target, with_separator):
    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    translator = PrefillTranslator(with_separator=with_separator)
    cag = CAG(base.store, find_translator=lambda src, tgt: translator)
    q = "Why did ships pass safely?"
    # one chunk: the translated cache is then exactly the target's own prefill
    tr = cag.ask(q, target=models[target], max_new_tokens=8, top_k=1)
    assert tr.mode == "translate" and translator.calls == 1
    native = cag.ask(q, target=models[target], mode="native", max_new_tokens=8, top_k=1)
    assert tr.token_ids == native.token_ids and tr.tokens == native.tokens
    assert tr.timings_ms["translate"] > 0 and native.timings_ms["translate"] == 0
    # a card below the threshold: auto falls back to native and says why
    cag_low = CAG(base.store, find_translator=lambda src, tgt: PrefillTranslator(ok=False))
    low = cag_low.ask(q, target=models[target], max_new_tokens=2)
    assert low.mode == "native" and "threshold" in low.mode_reason
    # several chunks: separators computed between translated blocks; same layout as native
    three = cag.ask(q, target=models[target], max_new_tokens=2, top_k=3)
    native3 = cag.ask(q, target=models[target], mode="native", max_new_tokens=2, top_k=3)
    assert three.mode == "translate"
    assert (three.tokens["context"], three.tokens["prompt"]) == (native3.tokens["context"], native3.tokens["prompt"])


@pytest.mark.parametrize("target", ["qwen2", "gemma"])
@pytest.mark.parametrize("fuse", [True, False])
def test_separators_computed_once_equal_one_forward_each(tmp_path, models, target, fuse):
    """Every separator between translated blocks is computed in one pass: the question's own
    forward (`fuse_feed`) or a pass of their own; the answer's logits and the cache are those
    a forward per separator, then the question's, builds (Gemma: 3 chunks overflow its
    sliding window of 8)."""
    from cagkv.models import append_kv
    from cagkv.pipeline import _forward
    from cagkv.refresh import feed

    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    translator = PrefillTranslator(with_separator=False)
    cag = CAG(base.store, find_translator=lambda src, tgt: translator)
    cag.fuse_feed = fuse
    prepared = cag.prepare("Why did ships pass safely?", target=models[target], mode="translate", top_k=3)
    loaded = cag.model(models[target])
    fmt = PromptFormat.for_model(loaded)
    blocks = [translator.translate(cag.store.load_blocks([s.chunk])[0], loaded) for s in prepared.sources[::-1]]
    assert len(blocks) == 3
    cache, n = cag.prefix_cache(loaded, fmt)
    gaps = []
    for i, block in enumerate(blocks):  # the reference: one forward per separator
        append_kv(cache, loaded.spec, block.keys, block.values, torch.arange(n, n + block.num_tokens))
        n += block.num_tokens
        if i < len(blocks) - 1:
            cache = _forward(loaded, fmt.separator_ids(), cache, n).cache
            gaps += range(n, n + len(fmt.separator_ids()))
            n += len(fmt.separator_ids())
    assert n == prepared.next_position and prepared.prompt_ids[: len(fmt.separator_ids())] == fmt.separator_ids()
    assert prepared.stale == ({p: t for p, t in zip(gaps, fmt.separator_ids() * 2)} if fuse else {})
    want = _forward(loaded, prepared.prompt_ids, cache, n)
    got_cache, got = feed(loaded.model, copy.deepcopy(prepared.cache), n, prepared.prompt_ids, prepared.stale)
    torch.testing.assert_close(got[-1], want.logits[0, -1], atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(got_cache.layers, want.cache.layers):
        assert mine.keys.shape == theirs.keys.shape and mine.get_seq_length() == theirs.get_seq_length()
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    answer = cag.generate(prepared, max_new_tokens=4)
    assert answer.tokens["prompt"] == n + len(prepared.prompt_ids)


class NoiseTranslator(PrefillTranslator):
    """The chunk's own tokens with random K/V: a translation that carries nothing."""

    def __init__(self):
        super().__init__(with_separator=False)

    def translate(self, block, target):
        out = super().translate(block, target)
        g = torch.Generator().manual_seed(self.calls)
        return KVBlock(torch.randn(out.keys.shape, generator=g), torch.randn(out.values.shape, generator=g),
                       out.token_ids, out.offsets, out.text, out.model_fingerprint)  # fmt: skip


class OffsetTranslator(PrefillTranslator):
    """Native K/V minus one known offset per layer and KV head (keys before RoPE)."""

    def __init__(self, keys, values):
        super().__init__(with_separator=False)
        self.keys, self.values = keys, values

    def translate(self, block, target):
        out = super().translate(block, target)
        return KVBlock(out.keys - self.keys[:, :, None], out.values - self.values[:, :, None], out.token_ids,
                       out.offsets, out.text, out.model_fingerprint)  # fmt: skip


def test_fit_kv_bias_finds_a_translators_shared_offset_through_the_engine(tmp_path, models):
    target = "qwen2"  # the store's canonical is llama; the tiny Gemma's window (8) cannot hold a chunk
    from cagkv.translate.kv_bias import fit_kv_bias

    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    spec = base.model(models[target]).spec
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(spec.num_layers, spec.num_kv_heads, spec.head_dim, generator=g) for _ in range(2))
    cag = CAG(base.store, find_translator=lambda src, tgt: OffsetTranslator(keys, values))
    documents = [d.id for d in base.store.list_documents()]
    bias = fit_kv_bias(cag, models[target], documents)
    torch.testing.assert_close(bias["keys"], keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bias["values"], values, atol=1e-4, rtol=1e-4)
    assert int(bias["tokens"]) >= 2 * 12  # both documents' first chunks, each of several tokens


def _next_token_logits(cag, prepared):
    from cagkv.eval.runner import continuation_logits

    return continuation_logits(prepared, prepared.prompt_ids)[-1]


@pytest.mark.parametrize("target", ["qwen2", "gemma"])
def test_refreshing_every_token_of_a_useless_translation_gives_native_prefill(tmp_path, models, target):
    # Gemma's tiny sliding window (8) is shorter than the chunk: the cache must keep every token
    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    cag = CAG(base.store, find_translator=lambda src, tgt: NoiseTranslator())
    q = "Why did ships pass safely?"
    native = cag.prepare(q, target=models[target], mode="native", top_k=1)
    noisy = cag.prepare(q, target=models[target], mode="translate", top_k=1)
    full = cag.prepare(q, target=models[target], mode="translate", top_k=1, refresh=1.0)
    want = _next_token_logits(cag, native)
    assert not torch.allclose(_next_token_logits(cag, noisy), want, atol=1e-3)
    torch.testing.assert_close(_next_token_logits(cag, full), want, atol=1e-4, rtol=1e-4)
    assert full.timings_ms["replay"] > 0 and noisy.timings_ms["replay"] == 0
    answer = cag.generate(full, max_new_tokens=6)
    assert answer.token_ids == cag.generate(native, max_new_tokens=6).token_ids


def test_the_cards_default_refresh_applies_when_none_is_asked(tmp_path, models):
    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    translator = NoiseTranslator()
    translator.default_refresh = 1.0  # every chunk token: the answer becomes native prefill's
    cag = CAG(base.store, find_translator=lambda src, tgt: translator)
    q = "Why did ships pass safely?"
    want = _next_token_logits(cag, cag.prepare(q, target=models["qwen2"], mode="native", top_k=1))
    default = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=1)
    off = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=1, refresh=0)
    torch.testing.assert_close(_next_token_logits(cag, default), want, atol=1e-4, rtol=1e-4)
    assert "default_refresh" in default.mode_reason and default.timings_ms["replay"] > 0
    assert off.timings_ms["replay"] == 0 and off.mode_reason == ""
    assert not torch.allclose(_next_token_logits(cag, off), want, atol=1e-3)
    # other modes never refresh, whatever the card says
    assert cag.prepare(q, target=models["qwen2"], mode="native", top_k=1).timings_ms["replay"] == 0


def test_refresh_recomputes_the_asked_share_of_the_chunk_tokens_only(tmp_path, models):
    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    cag = CAG(base.store, find_translator=lambda src, tgt: NoiseTranslator())
    prepared = cag.prepare("Why did ships pass safely?", target=models["qwen2"], mode="translate", top_k=3,
                           refresh=0.25)  # fmt: skip
    blocks = [cag.store.load_blocks([s.chunk])[0] for s in prepared.sources]  # best first
    loaded = cag.model(models["qwen2"])
    ids = [PromptFormat.for_model(loaded).chunk_ids(b.text) for b in blocks]
    prefix = len(PromptFormat.for_model(loaded).context_prefix_ids())
    positions, token_ids = zip(*sorted(prepared.stale.items()))  # the question's forward recomputes them
    assert len(positions) == round(0.25 * sum(map(len, ids)))
    # blocks sit best chunk last, each followed by the separator; only their tokens are chosen
    sep, at, allowed = len(PromptFormat.for_model(loaded).separator_ids()), prefix, {}
    for chunk in reversed(ids):
        allowed.update(zip(range(at, at + len(chunk)), chunk))
        at += len(chunk) + sep
    assert all(allowed.get(p) == t for p, t in zip(positions, token_ids))
    with pytest.raises(UsageError, match="refresh needs mode translate"):
        cag.prepare("q?", target=models["qwen2"], mode="native", refresh=0.5)
    with pytest.raises(UsageError, match="fraction"):
        cag.prepare("q?", target=models["qwen2"], mode="translate", refresh=1.5)
    with pytest.raises(UsageError, match="refresh_scoring"):
        cag.prepare("q?", target=models["qwen2"], mode="translate", refresh=0.5, refresh_scoring="loud")


@pytest.mark.parametrize("target", ["qwen2", "gemma"])
def test_attention_bias_names_the_tokens_left_translated_and_reaches_scoring_and_decoding(tmp_path, models, target):
    """The bias covers every chunk token a refresh leaves translated (not the prefix, the
    separators or the refreshed tokens); the question's forward and every decoding step read it."""
    from cagkv.models.layers import forward_at
    from cagkv.refresh import feed

    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    q = "Why did ships pass safely?"
    runs = {}
    for bias in (None, 0.0, 3.0):  # an engine each: the noise translator's draws follow its calls
        cag = CAG(base.store, find_translator=lambda src, tgt: NoiseTranslator())
        runs[bias] = cag.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.25, attention_bias=bias)
    assert runs[None].bias is None and runs[0.0].bias is None  # the noise translator has no card: 0
    prepared = runs[3.0]
    fmt = prepared.fmt
    blocks = [cag.store.load_blocks([s.chunk])[0] for s in prepared.sources]  # best first
    at, chunk = len(fmt.context_prefix_ids()), set()
    for block in reversed(blocks):  # best chunk last, each followed by the separator
        n = len(fmt.chunk_ids(block.text))
        chunk.update(range(at, at + n))
        at += n + len(fmt.separator_ids())
    refreshed = chunk & set(prepared.stale)
    assert refreshed and set(prepared.bias.positions.tolist()) == chunk - refreshed
    assert prepared.bias.value == 3.0

    model = prepared.target.model
    scored = _next_token_logits(cag, prepared)
    assert not torch.allclose(scored, _next_token_logits(cag, runs[0.0]), atol=1e-3)
    answer = cag.generate(copy.deepcopy(prepared), max_new_tokens=5)
    with torch.inference_mode():  # greedy by hand, the bias at every step
        cache, logits = feed(model, copy.deepcopy(prepared.cache), prepared.next_position, prepared.prompt_ids,
                             prepared.stale, bias=prepared.bias)
        torch.testing.assert_close(logits[-1], scored, atol=1e-4, rtol=1e-4)
        position, tokens = prepared.next_position + len(prepared.prompt_ids), []
        for _ in range(len(answer.token_ids)):
            tokens.append(int(logits[-1].argmax()))
            logits = forward_at(model, [tokens[-1]], position, cache, bias=prepared.bias).logits[0]
            position += 1
    assert answer.token_ids == tokens
    scoped = cag.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.25, attention_bias=3.0,
                         attention_bias_scope="question")
    assert scoped.bias.until == scoped.next_position + len(scoped.prompt_ids)  # the answer's tokens: no bias
    first3 = cag.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.25, attention_bias=3.0,
                         attention_bias_scope="answer3")
    assert first3.bias.until == first3.next_position + len(first3.prompt_ids) + 3  # and the first 3 answer tokens
    assert prepared.bias.until is None
    with pytest.raises(UsageError, match="attention_bias_scope"):
        cag.prepare(q, target=models[target], mode="translate", attention_bias=1.0, attention_bias_scope="answer")
    with pytest.raises(UsageError, match="answerK"):
        cag.prepare(q, target=models[target], mode="translate", attention_bias=1.0, attention_bias_scope="answer-2")
    sliding = cag.prepare(q, target=models["gemma"], mode="translate", top_k=3, attention_bias=3.0,
                          attention_bias_scope="answer1,sliding")
    assert sliding.bias.kinds == {"sliding_attention"} and sliding.bias.until == (
        sliding.next_position + len(sliding.prompt_ids) + 1)
    rest = cag.prepare(q, target=models["gemma"], mode="translate", top_k=3, attention_bias=3.0,
                       attention_bias_scope="question,rest:full")
    assert rest.bias.kinds is None and rest.bias.rest_kinds == {"full_attention"}
    with pytest.raises(UsageError, match="has no sliding_attention layers"):  # Qwen2's tiny model: full attention only
        cag.prepare(q, target=models["qwen2"], mode="translate", attention_bias=1.0, attention_bias_scope="sliding")
    class CardBias(NoiseTranslator):  # a card naming attention_bias: used where a refresh runs only
        attention_bias = -0.5

    card = CAG(base.store, find_translator=lambda src, tgt: CardBias())
    refreshed = card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.25)
    assert refreshed.bias.value == -0.5 and "attention bias -0.5" in refreshed.mode_reason
    assert card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0).bias is None

    class CardBiasR0(CardBias):  # and attention_bias_r0: pure translation only (no refresh, no replay)
        attention_bias_r0 = -0.25

    both = CAG(base.store, find_translator=lambda src, tgt: CardBiasR0())
    pure = both.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0)
    assert pure.bias.value == -0.25 and "card's attention_bias_r0" in pure.mode_reason
    assert set(pure.bias.positions.tolist()) == chunk  # every chunk token: none refreshed
    assert both.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.25).bias.value == -0.5
    assert pure.bias.until is None  # the card names no scope: every fed token

    class CardScoped(CardBiasR0):  # and a scope for it: the question's and the first 2 answer tokens'
        attention_bias_r0_scope = "answer2"

    scoped_card = CAG(base.store, find_translator=lambda src, tgt: CardScoped())
    first2 = scoped_card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0)
    assert first2.bias.until == first2.next_position + len(first2.prompt_ids) + 2 and "scope answer2" in first2.mode_reason
    assert scoped_card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0,
                               attention_bias_scope="all").bias.until is None  # asked for: the caller's scope
    assert scoped_card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.25).bias.until is None
    assert card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=1.0).bias is None  # all native
    assert card.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0, attention_bias=0.7).bias.value == 0.7
    with pytest.raises(UsageError, match="attention_bias acts on translated tokens"):
        cag.prepare(q, target=models[target], mode="native", attention_bias=0.5)
    with pytest.raises(UsageError, match="finite"):
        cag.prepare(q, target=models[target], mode="translate", attention_bias=float("nan"))


def test_refresh_shift_moves_the_tokens_left_translated_and_refreshes_before_the_question(tmp_path, models, monkeypatch):
    """With `refresh_shift` the chosen tokens are recomputed before the question (not in its
    forward), and the blocks' other tokens move (`cagkv.refresh.shift_translated`); the
    refreshed tokens themselves are those of a plain refresh."""
    import cagkv.refresh

    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    q, target = "Why did ships pass safely?", models["qwen2"]
    monkeypatch.setattr(cagkv.refresh, "MIN_SHIFT_TOKENS", 1)
    runs = {}
    for shift in (False, True):
        monkeypatch.setenv("CAGKV_FUSE_FEED", "0" if not shift else "1")  # the plain run refreshes first too
        cag = CAG(base.store, find_translator=lambda src, tgt: NoiseTranslator())
        runs[shift] = cag.prepare(q, target=target, mode="translate", top_k=3, refresh=0.4, refresh_shift=shift)
    plain, shifted = runs[False], runs[True]
    assert shifted.stale == {} and plain.stale == {}
    moved = [int((a.values != b.values).any(dim=-1).sum()) for a, b in zip(plain.cache.layers, shifted.cache.layers)]
    assert sum(moved) > 0
    with pytest.raises(UsageError, match="refresh_shift"):
        cag.prepare(q, target=target, mode="translate", refresh=0, refresh_shift=True)


@pytest.mark.parametrize("target", ["qwen2", "gemma"])
def test_refresh_in_the_questions_forward_equals_refreshing_first(tmp_path, models, target, monkeypatch):
    """`fuse_feed` recomputes the chosen tokens in the question's own forward: the same choice,
    the same answer logits and the same cache as refreshing them in a pass of their own."""
    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    q = "Why did ships pass safely?"
    results = []
    for fuse in (True, False):  # an engine each: the noise translator's draws follow its calls
        monkeypatch.setenv("CAGKV_FUSE_FEED", "1" if fuse else "0")
        cag = CAG(base.store, find_translator=lambda src, tgt: NoiseTranslator())
        assert cag.fuse_feed is fuse
        prepared = cag.prepare(q, target=models[target], mode="translate", top_k=3, refresh=0.4)
        results.append((prepared, _next_token_logits(cag, prepared)))
    (fused, fused_logits), (first, first_logits) = results
    assert len(fused.stale) == round(0.4 * (fused.context_tokens - 2 * len(fused.fmt.separator_ids()))) > 0
    assert first.stale == {}
    torch.testing.assert_close(fused_logits, first_logits, atol=1e-4, rtol=1e-4)
    from cagkv.refresh import feed

    fed = [feed(p.target.model, copy.deepcopy(p.cache), p.next_position, p.prompt_ids, p.stale)[0] for p in (fused, first)]
    for mine, theirs in zip(fed[0].layers, fed[1].layers):  # the fused cache in the model's layout (a window)
        held = mine.keys.shape[2]
        torch.testing.assert_close(mine.keys, theirs.keys[:, :, -held:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values[:, :, -held:], atol=1e-5, rtol=1e-5)
    answers = [cag.generate(p, max_new_tokens=6) for p in (fused, first)]  # the engine's model: shared
    assert answers[0].token_ids == answers[1].token_ids


def test_contrast_scoring_measures_a_neutral_prompt_and_refreshes_the_same_share(tmp_path, models, monkeypatch):
    import cagkv.refresh

    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    cag = CAG(base.store, find_translator=lambda src, tgt: NoiseTranslator())
    real_attention, passes = cagkv.refresh.prompt_attention, []

    def attention(model, cache, n, prompts):
        passes.append([list(p) for p in prompts])
        return real_attention(model, cache, n, prompts)

    monkeypatch.setattr(cagkv.refresh, "prompt_attention", attention)
    chosen = []
    question = "Why did ships pass safely?"
    for scoring in ("attention", "contrast", "pooled", "averaged", "drafted"):
        prepared = cag.prepare(question, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25,
                               refresh_scoring=scoring)  # fmt: skip
        chosen.append(sorted(prepared.stale))  # left for the question's forward to recompute
    fmt = PromptFormat.for_model(cag.model(models["qwen2"]))
    # attention: one pass of the question; contrast and pooled: one pass of the question and the
    # first neutral prompt; averaged: one pass of the question and every neutral prompt
    # drafted: the question followed by its drafted answer, and the first neutral prompt
    assert [len(p) for p in passes] == [1, 2, 2, 1 + len(NEUTRAL_QUESTIONS), 2]
    assert passes[4][1] == passes[1][1] and passes[4][0][: len(passes[0][0])] == passes[0][0]
    assert len(passes[4][0]) > len(passes[0][0])
    assert passes[1][0] == passes[0][0] and passes[2] == passes[1] and passes[3][:2] == passes[1]
    pending = passes[0][0][: len(passes[0][0]) - len(fmt.question_suffix_ids(question))]
    assert passes[3][1:] == [pending + fmt.question_suffix_ids(q) for q in NEUTRAL_QUESTIONS]
    assert len(chosen[0]) == len(chosen[1]) == len(chosen[2]) == len(chosen[3]) == len(chosen[4]) > 0
    # pooling makes runs of neighbours: the pooled choice is never more scattered than contrast's
    runs = [1 + sum(b != a + 1 for a, b in zip(c, c[1:])) for c in chosen]
    assert runs[2] <= runs[1]


def _noise_engine(tmp_path, models) -> tuple[NoiseTranslator, CAG]:
    """An engine over DOC_A and DOC_B whose every translation is a NoiseTranslator's (no difficulty table yet)."""
    _, base = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    translator = NoiseTranslator()
    return translator, CAG(base.store, find_translator=lambda src, tgt: translator)


def test_a_bias_scoped_hard_reaches_the_share_of_the_translated_tokens_the_table_finds_hardest(tmp_path, models):
    translator, cag = _noise_engine(tmp_path, models)
    q = "Why did ships pass safely?"
    with pytest.raises(UsageError, match="difficulty table"):  # refused before any work
        cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, attention_bias=-1.0,
                    attention_bias_scope="hard0.3")
    assert translator.calls == 0
    vocab = cag.model(models["qwen2"]).model.config.vocab_size
    translator.difficulty = torch.rand(vocab, generator=torch.Generator().manual_seed(0))
    every = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, attention_bias=-1.0)
    hard = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, attention_bias=-1.0,
                       attention_bias_scope="question,hard0.3")
    assert hard.bias.until == hard.next_position + len(hard.prompt_ids)
    translated = every.bias.positions.tolist()
    blocks = [cag.store.load_blocks([s.chunk])[0] for s in reversed(hard.sources)]  # in context order
    fmt = PromptFormat.for_model(cag.model(models["qwen2"]))
    ids = [t for b in blocks for t in fmt.chunk_ids(b.text)]
    assert len(ids) == len(translated)
    expected = {p: float(translator.difficulty[t]) for p, t in zip(translated, ids)}
    kept = hard.bias.positions.tolist()
    assert len(kept) == round(0.3 * len(translated)) and set(kept) <= set(translated)
    assert min(expected[p] for p in kept) >= max(expected[p] for p in translated if p not in kept)


def test_a_bias_scoped_fitted_carries_the_translators_table_and_is_refused_without_one(tmp_path, models):
    translator, cag = _noise_engine(tmp_path, models)
    q = "Why did ships pass safely?"
    ask = dict(target=models["qwen2"], mode="translate", top_k=3, attention_bias=0.5)
    translator.attention_fit = None
    with pytest.raises(UsageError, match="fitted attention table"):
        cag.prepare(q, attention_bias_scope="fitted", **ask)
    config = cag.model(models["qwen2"]).model.config
    translator.attention_fit = torch.ones(config.num_hidden_layers, config.num_attention_heads + 1)
    with pytest.raises(UsageError, match="heads"):
        cag.prepare(q, attention_bias_scope="answer2,fitted", **ask)
    assert translator.calls == 0  # refused before any work
    translator.attention_fit = torch.randn(config.num_hidden_layers, config.num_attention_heads)
    fitted = cag.prepare(q, attention_bias_scope="answer2,fitted", **ask)
    assert fitted.bias.per_layer is translator.attention_fit and fitted.bias.value == 0.5
    assert cag.prepare(q, **ask).bias.per_layer is None


def test_difficulty_scoring_refreshes_the_tokens_the_translators_table_finds_hardest(tmp_path, models):
    translator, cag = _noise_engine(tmp_path, models)
    q = "Why did ships pass safely?"
    with pytest.raises(UsageError, match="difficulty table"):  # refused before any work
        cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25, refresh_scoring="difficulty")
    assert translator.calls == 0
    vocab = cag.model(models["qwen2"]).model.config.vocab_size
    hard = list(range(0, vocab, 3))  # every third token id is hard, the rest easy
    translator.difficulty = torch.full((vocab,), 0.5)
    translator.difficulty[hard] = 2.0
    prepared = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25,
                           refresh_scoring="difficulty")  # fmt: skip
    chosen = set(prepared.stale.values())
    blocks = [cag.store.load_blocks([s.chunk])[0] for s in prepared.sources]
    fmt = PromptFormat.for_model(cag.model(models["qwen2"]))
    ids = [t for b in blocks for t in fmt.chunk_ids(b.text)]
    share = round(0.25 * len(ids))
    assert len(prepared.stale) == share
    n_hard = sum(t in set(hard) for t in ids)
    # the table decides: hard tokens first, easy ones only once every hard one is taken
    assert (chosen <= set(hard)) if n_hard >= share else (set(hard) & set(ids) <= chosen)
    both = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25,
                       refresh_scoring="contrast_difficulty")  # fmt: skip
    assert len(both.stale) == share
    # the card's scoring is used when none is asked, and said so
    translator.default_refresh_scoring = "difficulty"
    default = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25)
    assert default.stale == prepared.stale and "default_refresh_scoring" in default.mode_reason
    asked = cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25, refresh_scoring="contrast")
    assert asked.stale != prepared.stale and "scoring" not in asked.mode_reason  # contrast chose others
    # adaptive switches at the translator's own threshold: contrast above it, the product below
    def chosen_by(scoring):
        translator.calls = 0  # the same noise each time (NoiseTranslator seeds by call count)
        return cag.prepare(q, target=models["qwen2"], mode="translate", top_k=3, refresh=0.25,
                           refresh_scoring=scoring).stale  # fmt: skip

    by_contrast, by_product = chosen_by("contrast"), chosen_by("contrast_difficulty")
    assert by_contrast != by_product  # so the two branches are told apart
    translator.peak_z = 1e-9
    assert chosen_by("adaptive") == by_contrast
    translator.peak_z = float("inf")
    assert chosen_by("adaptive") == by_product


def test_stream_yields_the_answer(tmp_path, models):
    _, cag = make_store(tmp_path, models["gemma"], [DOC_A])
    stream = cag.ask_stream("Who lit the lamp?", mode="canonical", max_new_tokens=10)
    pieces = list(stream)
    answer = stream.answer
    assert answer is not None and answer.mode == "canonical"
    assert "".join(pieces).strip() == answer.text
    assert answer.text == cag.ask("Who lit the lamp?", mode="canonical", max_new_tokens=10).text
    assert "\n" not in answer.text  # base models stop at the end of the answer line


def test_bad_questions_and_options(tmp_path, models):
    _, cag = make_store(tmp_path, models["llama"], [DOC_A])
    for bad in ("", "   \n"):
        with pytest.raises(UsageError, match="empty question"):
            cag.ask(bad)
    with pytest.raises(UsageError, match="unknown mode"):
        cag.ask("q?", mode="fast")
    with pytest.raises(UsageError, match="top_k"):
        cag.ask("q?", top_k=0)
    with pytest.raises(UsageError, match="max_new_tokens"):
        cag.ask("q?", max_new_tokens=0)
    with pytest.raises(UsageError, match="replay"):
        cag.ask("q?", replay=2, mode="native")


def test_ingest_is_idempotent_and_replaces_changed_files(tmp_path, models):
    _report, cag = make_store(tmp_path, models["llama"], [DOC_A, DOC_B], chunk_tokens=24)
    store = cag.store
    before = store.stats()
    again = ingest([str(tmp_path / "doc0.txt"), str(tmp_path / "doc1.txt")], tmp_path / "store",
                   chunk_tokens=24, dtype="float32", progress=False)  # fmt: skip
    assert again.documents == 0 and again.skipped == 2 and again.chunks == 0
    assert store.stats()["chunks"] == before["chunks"]
    (tmp_path / "doc0.txt").write_text("A different text. It has two sentences.")
    changed = ingest([str(tmp_path / "doc0.txt")], tmp_path / "store", dtype="float32", progress=False)
    assert changed.documents == 1 and changed.chunks == 1
    docs = {d.source: d for d in store.list_documents()}
    assert len(docs) == 2 and docs[str((tmp_path / "doc0.txt").resolve())].chunks == 1
    assert store.doctor().ok


def test_ingest_refuses_another_canonical_model(tmp_path, models):
    make_store(tmp_path, models["llama"], [DOC_A])
    with pytest.raises(StoreError, match="canonical"):
        ingest([str(tmp_path / "doc0.txt")], tmp_path / "store", canonical=models["qwen2"], progress=False)


def test_ingest_text_with_presplit_chunks_and_stdin(tmp_path, models):
    _, cag = make_store(tmp_path, models["llama"], [DOC_A])
    chunks = ["Paris is the capital of France.", "The river is the Seine."]
    result = ingest_text(cag.store, "\n\n".join(chunks), "nodes://x", metadata={"k": "v"}, chunks=chunks,
                         dtype="float32")  # fmt: skip
    assert result.status == "added" and result.chunks == 2
    import io

    sources = collect_sources(["-"], stdin=io.BytesIO(b"Read from standard input. Twice."))
    report = ingest_sources(cag.store, cag.model(models["llama"]), sources, progress=False)
    assert report.documents == 1 and report.sources == ["<stdin>"]
    assert {d.source for d in cag.store.list_documents()} >= {"nodes://x", "<stdin>"}


def test_prefill_blocks_batching_and_separator(models):
    from cagkv.models import load

    loaded = load(models["gemma"])
    fmt = PromptFormat.for_model(loaded)
    texts = ["Short one.", DOC_A, "A middle sized chunk of text here."]
    one_by_one = [prefill_chunks(loaded, [t], batch_size=1)[0] for t in texts]
    batched = prefill_chunks(loaded, texts, batch_size=3)  # right-padded batch, longest first
    sep = fmt.separator_ids()
    for text, a, b in zip(texts, one_by_one, batched):
        assert b.text == text and b.token_ids.tolist() == fmt.chunk_ids(text) + sep
        assert b.offsets[-1].tolist() == [len(text), len(text)] and b.extra["separator_tokens"] == str(len(sep))
        assert b.model_fingerprint == loaded.fingerprint and b.positions_free
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)


def test_ingest_streams_blocks_one_batch_at_a_time(tmp_path, models, monkeypatch):
    """Memory stays bounded: a batch's blocks are released before the next batch is made."""
    import weakref

    import cagkv.prefill

    real = cagkv.prefill.prefill_chunks
    made: list[weakref.ref] = []
    alive_at_call: list[int] = []

    def tracking(loaded, texts, batch_size=8, fmt=None):
        # blocks hold no reference cycles: reference counting frees them without gc.collect()
        alive_at_call.append(sum(r() is not None for r in made))
        blocks = real(loaded, texts, batch_size=batch_size, fmt=fmt)
        made.extend(weakref.ref(b) for b in blocks)
        return blocks

    monkeypatch.setattr(cagkv.prefill, "prefill_chunks", tracking)
    text = " ".join(f"Sentence number {i} is here." for i in range(40))
    (tmp_path / "long.txt").write_text(text)
    report = ingest([str(tmp_path / "long.txt")], tmp_path / "store", canonical=models["llama"], chunk_tokens=16,
                    batch_size=2, dtype="float32", embedder="hash-64", progress=False)  # fmt: skip
    assert report.chunks >= 10 and len(alive_at_call) >= 5
    assert max(alive_at_call) <= 2  # at most the previous batch, never the document's blocks


def test_ask_searches_again_when_a_writer_removed_a_hit(tmp_path, models, monkeypatch):
    """A hit removed between search and load (a concurrent `rm`) is retried, not an error."""
    from cagkv.stores.records import ChunksChangedError

    _, cag = make_store(tmp_path, models["llama"], [DOC_A, DOC_B])
    expected = cag.ask("Who lit the lamp?", mode="canonical", top_k=1, max_new_tokens=4)
    real_load, calls = cag.store.load_blocks, []

    def flaky_load(ids):
        calls.append(list(ids))
        if len(calls) == 1:
            raise ChunksChangedError("chunk removed by a concurrent writer")
        return real_load(ids)

    monkeypatch.setattr(cag.store, "load_blocks", flaky_load)
    answer = cag.ask("Who lit the lamp?", mode="canonical", top_k=1, max_new_tokens=4)
    assert len(calls) == 2
    assert answer.token_ids == expected.token_ids


class RecordingTranslator(PrefillTranslator):
    """A perfect translator that records the replay / window options the engine passed."""

    def __init__(self, default_replay=0):
        super().__init__()
        self.default_replay, self.kwargs = default_replay, []

    def translate(self, block, target, **kwargs):
        self.kwargs.append(kwargs)
        return super().translate(block, target)


def test_mot_window_mode_and_default_replay_reach_the_translator(tmp_path, models):
    _, base = make_store(tmp_path, models["llama"], [DOC_A], chunk_tokens=24)
    tr = RecordingTranslator(default_replay=3)
    cag = CAG(base.store, find_translator=lambda src, tgt: tr)
    q = "Who lit the lamp?"
    win = cag.ask(q, target=models["qwen2"], mode="mot-window", max_new_tokens=2, top_k=1)
    assert win.mode == "mot-window" and tr.kwargs[-1] == {"window": True}
    auto = cag.ask(q, target=models["qwen2"], max_new_tokens=2, top_k=1)  # auto: the card's default replay
    assert auto.mode == "translate" and tr.kwargs[-1] == {"replay": 3}
    cag.ask(q, target=models["qwen2"], mode="translate", replay=0, max_new_tokens=2, top_k=1)
    assert tr.kwargs[-1] == {}  # an explicit 0 wins over the default
    with pytest.raises(UsageError, match="mot-window needs a target other"):
        cag.ask(q, mode="mot-window")


class _ByteTokenizer:
    """Token i is byte i; decoding a cut UTF-8 sequence shows U+FFFD, as real tokenizers do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _decode(script: list[int], chat: bool, max_new_tokens: int = 16, stop: frozenset[int] = frozenset({0})):
    from cagkv.pipeline import greedy_decode
    from cagkv.prompt import PromptFormat

    fmt = PromptFormat(_ByteTokenizer(), chat, "", "", "", (), stop)
    fed: list[int] = []

    def logits_for(i: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(script[i]), 256).float()

    def step(token: int) -> torch.Tensor:
        fed.append(token)
        return logits_for(len(fed))

    return list(greedy_decode(fmt.tokenizer, fmt, logits_for(0), step, max_new_tokens)), fed


def test_greedy_decode_stops_on_a_stop_id_and_strips_the_leading_space() -> None:
    steps, fed = _decode(list(b" Paris") + [0, 65], chat=True)
    assert [piece for piece, _, _ in steps] == ["", "P", "a", "r", "i", "s"]
    assert steps[-1][1:] == (list(b" Paris"), "Paris")
    assert fed == list(b" Paris")  # the stop token is never fed


def test_greedy_decode_base_layout_ends_at_the_line_end_and_chat_does_not() -> None:
    script = list(b"Paris\nQuestion") + [0]
    base, fed = _decode(script, chat=False)
    assert base[-1][2] == "Paris" and fed == list(b"Paris")  # the newline is decoded, not fed
    chat, _ = _decode(script, chat=True)
    assert chat[-1][2] == "Paris\nQuestion"


def test_greedy_decode_holds_half_a_character_back_and_respects_the_limit() -> None:
    e_acute = list("é".encode())  # two bytes
    steps, _ = _decode(list(b"caf") + e_acute + [0], chat=True)
    assert [piece for piece, _, _ in steps] == ["c", "a", "f", "", "é"]
    limited, fed = _decode(list(b"abcdef"), chat=True, max_new_tokens=3)
    assert limited[-1][2] == "abc" and len(fed) == 2  # the last token is not fed
