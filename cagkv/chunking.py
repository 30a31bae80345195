"""Documents -> chunks of at most `max_tokens` model tokens, cut on sentence boundaries.

A sentence ends at ., ! or ? (closing quotes/brackets included) followed by whitespace,
or at a blank line. Sentences are packed greedily; a section heading (a Markdown `#`
line, or a line underlined with `***`, `===` or `---`) starts a new chunk once the
current one is at least half full, so headings stay with their section. A single
sentence longer than the budget is cut at token boundaries. Each chunk keeps its
character span in the document.

Example:
    >>> chunks = chunk_text(text, loaded.tokenizer, max_tokens=256)
    >>> chunks[0].text == text[chunks[0].start : chunks[0].end]
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# A sentence boundary: terminal punctuation (+ closing quotes) then whitespace, or a blank line.
_BOUNDARY = re.compile(r"[.!?。！？][\"'”’)\]]*\s+|\n[ \t]*\n\s*")
# Above this share of the budget the estimate (sum of per-sentence counts) is checked exactly.
_EXACT_CHECK_FROM = 0.85
# A section heading: "# Title" (Markdown) or a title line underlined with *, = or -.
_HEADING = re.compile(r"#{1,6} \S|[^\n]+\n[*=\-]{3,}[ \t]*(\n|$)")
# Cut before a heading once the chunk holds this share of the budget.
_HEADING_CUT_FROM = 0.5


@dataclass(frozen=True)
class TextChunk:
    """A chunk of a document: its text and character span [start, end) in the document."""

    text: str
    start: int
    end: int


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of `text`, surrounding whitespace excluded."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for match in _BOUNDARY.finditer(text):
        _add_span(text, pos, match.end(), spans)
        pos = match.end()
    _add_span(text, pos, len(text), spans)
    return spans


def _add_span(text: str, start: int, end: int, spans: list[tuple[int, int]]) -> None:
    piece = text[start:end]
    stripped = piece.strip()
    if stripped:
        lead = len(piece) - len(piece.lstrip())
        spans.append((start + lead, start + lead + len(stripped)))


def chunk_text(text: str, tokenizer: Any, max_tokens: int = 256) -> list[TextChunk]:
    """Split `text` into chunks of at most `max_tokens` tokens on sentence boundaries.

    Args:
        text: the document.
        tokenizer: a Hugging Face tokenizer (the canonical model's).
        max_tokens: token budget per chunk (special tokens not counted).
    Returns:
        chunks in document order; empty for blank text.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sentences = split_sentences(text)
    if not sentences:
        return []
    counts = _count_tokens(tokenizer, [text[s:e] for s, e in sentences])
    chunks: list[TextChunk] = []
    current: list[tuple[int, int]] = []  # sentence spans of the chunk being packed
    estimate = 0

    def flush() -> None:
        nonlocal current, estimate
        if current:
            start, end = current[0][0], current[-1][1]
            chunks.append(TextChunk(text[start:end], start, end))
        current, estimate = [], 0

    for (start, end), count in zip(sentences, counts):
        if count > max_tokens:  # one sentence over budget: cut it at token boundaries
            flush()
            chunks.extend(_hard_split(text, start, end, tokenizer, max_tokens))
            continue
        if current and _should_cut(text, current, start, end, count, estimate, tokenizer, max_tokens):
            flush()
        current.append((start, end))
        estimate += count
    flush()
    return chunks


def _should_cut(
    text: str,
    current: list[tuple[int, int]],
    start: int,
    end: int,
    count: int,
    estimate: int,
    tokenizer: Any,
    max_tokens: int,
) -> bool:
    """Whether the sentence [start, end) of `count` tokens starts a new chunk."""
    if estimate + count > max_tokens:  # it does not fit
        return True
    if estimate >= _HEADING_CUT_FROM * max_tokens and _HEADING.match(text, start):  # a heading
        return True
    # Near the budget, separately tokenized sentences may merge differently when joined.
    if estimate + count > _EXACT_CHECK_FROM * max_tokens:
        return _count_tokens(tokenizer, [text[current[0][0] : end]])[0] > max_tokens
    return False


def _count_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [len(ids) for ids in encoded]


def _hard_split(text: str, start: int, end: int, tokenizer: Any, max_tokens: int) -> list[TextChunk]:
    """Cut text[start:end] into pieces of at most `max_tokens` tokens at token boundaries.

    Greedy: take the longest prefix of whole tokens whose stripped text still fits (a
    stripped piece can tokenize differently from inside the sentence), then continue.
    """
    out: list[TextChunk] = []
    pos = start
    window = max(64, 16 * max_tokens)  # characters looked at per cut; plenty for any tokenizer
    while pos < end:
        rest = text[pos : min(end, pos + window)]
        ends = _token_ends(tokenizer, rest)
        take = min(max_tokens, len(ends))
        cut = len(rest) if pos + len(rest) == end and take == len(ends) else ends[take - 1]
        while True:
            spans: list[tuple[int, int]] = []
            _add_span(rest, 0, cut, spans)
            if not spans or _count_tokens(tokenizer, [rest[spans[0][0] : spans[0][1]]])[0] <= max_tokens:
                break
            take -= 1
            cut = ends[take - 1] if take > 0 else max(1, cut // 2)  # last resort: halve characters
        out.extend(TextChunk(rest[s:e], pos + s, pos + e) for s, e in spans)
        pos += cut
    return out


def _token_ends(tokenizer: Any, text: str) -> list[int]:
    """Character end of each token of `text` (words when the tokenizer has no offsets)."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, TypeError, KeyError):  # slow tokenizer: words instead
        offsets = [(m.start(), m.end()) for m in re.finditer(r"\S+\s*", text)]
    ends = [int(e) for _, e in offsets if e > 0]
    return ends or [len(text)]
