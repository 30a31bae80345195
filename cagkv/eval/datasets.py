"""QA examples in the shared JSONL schema, and the seeded sample an evaluation runs on.

One JSON object per line: `{"id", "dataset", "context", "question", "answers": [str, ...],
"answer_type", "meta": {...}}` (see `../shared/data/README.md`). `dataset` and `meta` are
optional here so that a user's own file with the five core keys works too.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cagkv.errors import UsageError

REQUIRED_KEYS = ("id", "context", "question", "answers")


@dataclass(frozen=True)
class Example:
    """One question about one context, with every gold answer."""

    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_type: str = "extractive"
    dataset: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def read_examples(path: str | Path) -> list[Example]:
    """Read every example of a JSONL file, in file order; bad lines raise `UsageError`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"dataset file not found: {path}")
    examples: list[Example] = []
    seen: set[str] = set()
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise UsageError(f"{path}:{number}: not UTF-8 (invalid byte at column {err.start + 1})") from None
            if not line.strip():
                continue
            example = _parse_line(line, path, number)
            if example.id in seen:
                raise UsageError(f"{path}:{number}: duplicate id {example.id!r}")
            seen.add(example.id)
            examples.append(example)
    if not examples:
        raise UsageError(f"dataset file has no examples: {path}")
    return examples


def _parse_line(line: str, path: Path, number: int) -> Example:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in obj]
    if missing:
        raise UsageError(f"{path}:{number}: missing keys {missing}, expected {list(REQUIRED_KEYS)}")
    for key in ("context", "question"):
        if not isinstance(obj[key], str):
            raise UsageError(f"{path}:{number}: {key!r} must be a string, got {type(obj[key]).__name__}")
    if isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int)):
        raise UsageError(f"{path}:{number}: 'id' must be a string or an integer, got {type(obj['id']).__name__}")
    if not isinstance(obj.get("meta") or {}, dict):
        raise UsageError(f"{path}:{number}: 'meta' must be a JSON object, got {type(obj['meta']).__name__}")
    for key in ("answer_type", "dataset"):
        if key in obj and not isinstance(obj[key], str):
            raise UsageError(f"{path}:{number}: {key!r} must be a string, got {type(obj[key]).__name__}")
    answers = obj["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise UsageError(f"{path}:{number}: 'answers' must be a non-empty list of strings")
    if not obj["question"].strip():
        raise UsageError(f"{path}:{number}: empty question")
    return Example(
        id=str(obj["id"]),
        context=str(obj["context"]),
        question=str(obj["question"]),
        answers=tuple(answers),
        answer_type=str(obj.get("answer_type", "extractive")),
        dataset=str(obj.get("dataset", path.stem)),
        meta=dict(obj.get("meta") or {}),
    )


def sample_examples(examples: list[Example], limit: int | None, seed: int = 0) -> list[Example]:
    """A seeded sample of `limit` examples (all when `limit` is None), in sampled order.

    The order is one fixed permutation per seed, so the sample of N is a prefix of the
    sample of M > N: a larger run with the same seed extends a smaller one.
    """
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be positive, got {limit}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    return [examples[i] for i in order]


def load_dataset(path: str | Path, limit: int | None = None, seed: int = 0,
                 max_context_chars: int | None = None) -> list[Example]:
    """`read_examples`, those with contexts of at most `max_context_chars` characters (all
    when None), then `sample_examples`: what `cagkv eval --dataset --limit --seed` runs on."""
    examples = read_examples(path)
    if max_context_chars is not None:
        examples = [e for e in examples if len(e.context) <= max_context_chars]
        if not examples:
            raise UsageError(f"{path}: no example has a context of at most {max_context_chars} characters")
    return sample_examples(examples, limit, seed)


def unique_contexts(examples: list[Example]) -> list[str]:
    """Distinct contexts in first-seen order (several SQuAD questions share a paragraph)."""
    return list(dict.fromkeys(example.context for example in examples))
