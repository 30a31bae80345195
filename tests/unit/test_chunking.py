"""chunk_text: budgets, sentence boundaries, spans, long sentences."""

from __future__ import annotations

import itertools

import pytest
from engine_helpers import make_tokenizer

from cagkv.chunking import chunk_text, split_sentences

TEXT = (
    "The cat sat on the mat. It was a sunny day! Was the dog there? No.\n\n"
    "A new paragraph starts here without a final stop\n\n"
    "Dr. Who met \"Alice.\" Then they left."
)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(chat=True)


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_split_sentences_spans():
    spans = split_sentences(TEXT)
    pieces = [TEXT[s:e] for s, e in spans]
    assert pieces[:4] == ["The cat sat on the mat.", "It was a sunny day!", "Was the dog there?", "No."]
    assert "A new paragraph starts here without a final stop" in pieces
    assert pieces[-1] == "Then they left."
    assert split_sentences("   \n\n ") == []


@pytest.mark.parametrize("budget", [1, 5, 12, 40, 1000])
def test_chunks_respect_budget_and_spans(tok, budget):
    chunks = chunk_text(TEXT, tok, max_tokens=budget)
    assert chunks
    for c in chunks:
        assert c.text == TEXT[c.start : c.end] and c.text == c.text.strip()
        assert n_tokens(tok, c.text) <= budget
    # in order, non-overlapping, and covering every non-space character
    assert all(a.end <= b.start for a, b in itertools.pairwise(chunks))
    covered = "".join(c.text for c in chunks)
    assert covered.replace(" ", "").replace("\n", "") == TEXT.replace(" ", "").replace("\n", "")


def test_big_budget_keeps_one_chunk_and_cuts_on_sentences(tok):
    assert len(chunk_text(TEXT, tok, max_tokens=1000)) == 1
    chunks = chunk_text(TEXT, tok, max_tokens=40)  # every sentence fits
    assert len(chunks) > 1
    # every cut falls after a sentence end (no sentence is split when each fits the budget)
    ends = {e for _, e in split_sentences(TEXT)}
    assert all(c.end in ends for c in chunks)


def test_long_sentence_is_cut_on_tokens(tok):
    text = "word " * 300 + "end."
    chunks = chunk_text(text, tok, max_tokens=50)
    assert len(chunks) >= 6
    assert all(n_tokens(tok, c.text) <= 50 for c in chunks)
    assert chunks[-1].text.endswith("end.")


def test_empty_and_bad_budget(tok):
    assert chunk_text("  \n ", tok) == []
    with pytest.raises(ValueError):
        chunk_text("x", tok, max_tokens=0)


def test_headings_start_a_new_chunk(tok):
    intro = "The cat sat on the mat. It was a sunny day. The dog was there too. " * 3
    intro = intro.strip()
    for heading in ("## Loops", "Loops\n*****"):
        text = f"{intro}\n\n{heading}\n\nA loop repeats. It ends."
        budget = n_tokens(tok, text) + 5  # everything would fit in one chunk
        half_full = n_tokens(tok, intro) >= budget / 2
        chunks = chunk_text(text, tok, max_tokens=budget)
        assert half_full and [c.text for c in chunks] == [intro, text[len(intro) :].strip()]
    # a chunk less than half full keeps the heading
    small = chunk_text("Short.\n\n## Loops\n\nA loop repeats.", tok, max_tokens=200)
    assert len(small) == 1
