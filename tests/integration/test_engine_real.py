"""The engine on the real models: ingest a small real document with SmolLM2-135M, answer in
`canonical` and `native` modes (identical greedy tokens for a single chunk), and answer
with another family (Gemma-3-270M) in `native` and `auto` modes."""

from __future__ import annotations

import pytest

from cagkv.models import zoo

pytestmark = pytest.mark.integration

# Python Language Reference, "The pass statement" (pydoc_data.topics, PSF licence).
DOC = (
    '"pass" is a null operation — when it is executed, nothing happens. It is useful as a '
    "placeholder when a statement is required syntactically, but no code needs to be executed."
)
QUESTION = "What happens when a pass statement is executed?"


def need(*names: str) -> None:
    for name in names:
        if not zoo.is_present(name):
            pytest.skip(f"{name} is not pulled into {zoo.models_dir()} (run: cagkv models pull {name})")


@pytest.fixture(scope="module")
def cag(tmp_path_factory):
    need("smollm2-135m", "minilm-l6")
    from cagkv.ingest import ingest
    from cagkv.pipeline import CAG

    root = tmp_path_factory.mktemp("engine_real")
    (root / "pass.txt").write_text(DOC)
    report = ingest([str(root / "pass.txt")], root / "store", canonical="smollm2-135m", dtype="float32",
                    progress=False)  # fmt: skip
    assert report.documents == 1 and report.chunks == 1
    return CAG.open(str(root / "store"))


def test_canonical_answers_from_stored_caches_like_native_prefill(cag):
    canonical = cag.ask(QUESTION, mode="canonical", max_new_tokens=16)
    native = cag.ask(QUESTION, mode="native", max_new_tokens=16)
    assert canonical.mode == "canonical" and native.mode == "native"
    assert canonical.token_ids == native.token_ids  # same greedy tokens: the cache is the native one
    assert "nothing" in canonical.text.lower()
    assert canonical.sources[0].text == DOC
    none = cag.ask(QUESTION, mode="none", max_new_tokens=16)
    assert none.tokens["context"] == 0 and none.tokens["prompt"] < canonical.tokens["prompt"]


def test_another_family_answers_natively_and_auto_says_so(cag):
    need("gemma3-270m")
    native = cag.ask(QUESTION, target="gemma3-270m", mode="native", max_new_tokens=12)
    assert native.target == "gemma3-270m" and native.tokens["context"] > 20
    assert native.text and "\n" not in native.text  # a base model: one answer line
    auto = cag.ask(QUESTION, target="gemma3-270m", max_new_tokens=12)
    assert auto.mode in ("native", "translate") and auto.mode_reason.startswith("auto")
    if auto.mode == "native":
        assert auto.token_ids == native.token_ids


def test_refresh_on_the_real_translator(cag):
    """Refresh 1.0 over the shipped SmolLM2 -> Gemma-3 translation is Gemma-3's own prefill
    (same greedy tokens); a third refreshed lands between translation and native on the
    answer's log-prob."""
    need("gemma3-270m")
    from cagkv.eval.runner import answer_logprob

    answer = "nothing happens"
    target = "gemma3-270m"
    native = cag.prepare(QUESTION, target=target, mode="native")
    if cag.prepare(QUESTION, target=target, mode="auto").mode != "translate":
        pytest.skip("no good-enough SmolLM2 -> Gemma-3 translator installed")
    full = cag.prepare(QUESTION, target=target, mode="translate", refresh=1.0)
    assert abs(answer_logprob(full, answer) - answer_logprob(native, answer)) < 1e-3
    assert cag.generate(full, 12).token_ids == cag.generate(native, 12).token_ids
    third = cag.prepare(QUESTION, target=target, mode="translate", refresh=1 / 3)
    assert third.timings_ms["replay"] > 0 and third.context_tokens == native.context_tokens
    assert answer_logprob(third, answer) > answer_logprob(cag.prepare(QUESTION, target=target, mode="none"), answer)
    # the shipped card's measured default_refresh (0.2, E45) applies when none is asked, and 0 turns it off
    default = cag.prepare(QUESTION, target=target, mode="translate")
    off = cag.prepare(QUESTION, target=target, mode="translate", refresh=0)
    assert "default_refresh" in default.mode_reason and default.timings_ms["replay"] > 0
    # and its attention_bias (-0.5, E87) on the tokens the refresh leaves translated; at r = 0 its
    # attention_bias_r0 (-0.25, E88) on every chunk token; both for the question and 4 answer tokens
    # in every layer, the later answer tokens in the full-attention layers (E93, E94)
    assert "attention bias -0.5" in default.mode_reason and default.bias is not None
    assert off.bias.value == -0.25 and "attention_bias_r0" in off.mode_reason
    for prepared in (default, off):
        assert "scope answer4,rest:full" in prepared.mode_reason and prepared.bias.kinds is None
        assert prepared.bias.rest_kinds == {"full_attention"}
        assert prepared.bias.until == prepared.next_position + len(prepared.prompt_ids) + 4
    assert off.timings_ms["replay"] == 0 and answer_logprob(default, answer) != answer_logprob(off, answer)
