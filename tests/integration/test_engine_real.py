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
