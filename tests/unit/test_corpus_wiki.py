"""The `wiki` training corpus: markup to prose, dump parsing, the contamination check."""

from __future__ import annotations

import bz2
import json
from pathlib import Path

import pytest

from cagkv.errors import UsageError
from cagkv.translate.corpus import (
    WIKI_EVAL_OVERLAP, load_documents, wiki_articles, wiki_plain_text, word_ngrams,
)

MARKUP = """{{Infobox person
| name = Ada {{nowrap|Lovelace}}
}}
'''Augusta Ada King''' was an English [[mathematician]] and [[Writer|writer]], chiefly known for her work on
[[Charles Babbage]]'s proposed mechanical general-purpose computer, the [[Analytical Engine]].<ref name="a">Toole, p. 12</ref>
[[File:Ada Lovelace portrait.jpg|thumb|left|200px|Portrait by [[Alfred Edward Chalon]]]]
== Early life ==
She was the only legitimate child of the poet [[Lord Byron]] and [[Anne Isabella Milbanke|Lady Byron]]; see [http://example.org the archive].<!-- hidden -->
{| class="wikitable"
| 1815 || born
|}
* Her notes include what is recognised as the first published algorithm <math>B_n</math> for a machine.
short line
"""


def test_markup_becomes_prose() -> None:
    text = wiki_plain_text(MARKUP)
    assert text.splitlines() == [
        "Augusta Ada King was an English mathematician and writer, chiefly known for her work on",
        "Charles Babbage's proposed mechanical general-purpose computer, the Analytical Engine.",
        "She was the only legitimate child of the poet Lord Byron and Lady Byron; see the archive.",
        "Her notes include what is recognised as the first published algorithm  for a machine.",
    ]


def _dump(pages: list[tuple[str, str, str]]) -> bytes:
    ns = "http://www.mediawiki.org/xml/export-0.10/"
    body = "".join(
        f"<page><title>{t}</title><ns>{n}</ns><revision><text xml:space=\"preserve\">{x}</text></revision></page>"
        for t, n, x in pages
    )
    return bz2.compress(f'<mediawiki xmlns="{ns}">{body}</mediawiki>'.encode())


def test_dump_keeps_articles_and_drops_redirects_and_other_namespaces(tmp_path: Path) -> None:
    path = tmp_path / "dump.xml.bz2"
    path.write_bytes(_dump([
        ("Albedo", "0", "'''Albedo''' is the measure of the diffuse reflection of solar radiation out of the total."),
        ("AccessibleComputing", "0", "#REDIRECT [[Computer accessibility]]"),
        ("Talk:Albedo", "1", "A discussion page about the article that is long enough to be kept otherwise."),
    ]))
    assert wiki_articles(path) == [
        ("Albedo", "Albedo is the measure of the diffuse reflection of solar radiation out of the total.")
    ]


def test_word_ngrams_find_copied_text_only() -> None:
    copied = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    evaluation = word_ngrams("unrelated") | word_ngrams(f"x {copied} y")
    assert word_ngrams(f"Before. {copied.upper()} after.") & evaluation == {
        " ".join(copied.split()[:13]), " ".join(copied.split()[1:14])
    }
    assert word_ngrams(copied) & word_ngrams(" ".join(copied.split()[:12])) == set()  # 12 words: below n
    assert word_ngrams(" ".join(copied.split()[:12])) == set()


SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is absent")
def test_wiki_corpus_shares_no_text_with_the_evaluation_sets() -> None:
    try:
        docs = load_documents(["wiki"])  # fetched once (pip download of the gensim wheel), then cached
    except UsageError as e:
        pytest.skip(str(e))
    assert len(docs) >= 90 and not {d.removeprefix("wiki:") for d, _ in docs} & WIKI_EVAL_OVERLAP
    evaluation = set().union(*(word_ngrams(json.loads(line)["context"]) for f in SHARED_DATA.glob("*.jsonl") for line in f.open()))
    assert [d for d, text in docs if word_ngrams(text) & evaluation] == []
