"""Questions a model writes about training chunks ("selfq" continuations).

The built-in continuation kinds quote the chunk ("follows": the words after a quoted cue;
"blank": a cloze of one of its sentences), so the target finds their answers by matching
tokens. Questions of QA sets paraphrase the text instead, and on all three shipped pairs
the answer is lost in the keys of the layers that do that retrieval (docs/EXPERIMENTS.md
E29, E31) while the corpus probe, built from the quoting kinds, is already at 92-101 %.
Here a model (the target, reading the chunk natively) writes one question about the chunk
and then answers it natively; Context Correction then trains on
chunk + question -> answer like on any other continuation, the teacher being the target's
own distribution over those answer tokens. No evaluation data is involved.

Samples with their continuations are kept as JSON lines (`save_samples` /
`load_samples`); `TrainConfig.samples_file` builds the training pairs from such a file.

Example:
    >>> samples = make_samples(load_documents(["wiki"]), 300, chars=(300, 520), kinds=("follows", "blank"))
    >>> with_q = add_self_questions(load("gemma3-270m"), samples)      # doctest: +SKIP
    >>> save_samples("wiki_selfq.jsonl", with_q)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cagkv.prompt import PromptFormat
from cagkv.translate.corpus import Continuation, Sample

if TYPE_CHECKING:
    from cagkv.models import LoadedModel

__all__ = ["INSTRUCTION", "parse_question", "parse_answer", "write_questions", "add_self_questions", "save_samples", "load_samples"]

INSTRUCTION = "Ask one question about a fact in the text above, then answer it briefly."
QUESTION_CUE = "Q:"  # opens the model's reply, so that it starts with the question itself
MAX_ANSWER_WORDS = 16


def parse_question(text: str) -> str | None:
    """The question a reply opened with `QUESTION_CUE` starts with: its first line, cut after
    the first "?"; None when there is no "?" or the question has under 4 words."""
    line = text.strip().split("\n", 1)[0]
    if "?" not in line:
        return None
    q = " ".join(line[: line.index("?") + 1].split())
    return q if len(q.split()) >= 4 else None


def parse_answer(text: str) -> str | None:
    """The first non-empty line of an answer, cut to `MAX_ANSWER_WORDS` words; None if empty."""
    words = text.strip().split("\n", 1)[0].split()[:MAX_ANSWER_WORDS]
    return " ".join(words) or None


@torch.no_grad()
def _greedy(loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int, stop: list[int]) -> list[str]:
    """Greedy replies to a batch of prompts (left-padded: every prompt ends where decoding starts)."""
    width = max(len(p) for p in prompts)
    pad = stop[0]
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=loaded.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=loaded.device)
    out = loaded.model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=stop, pad_token_id=pad)
    return [loaded.tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


def write_questions(loaded: LoadedModel, chunks: list[str], max_new_tokens: int = 32,
                    fmt: PromptFormat | None = None) -> list[tuple[str, str] | None]:
    """(question, answer) per chunk: the model, reading the chunk natively in the layout of
    `ask`, writes a question (greedy, after `INSTRUCTION` and `QUESTION_CUE`); then it answers
    that question natively in the layout of `ask`, which is the answer the teacher gives.
    None where either does not parse. The chunks go through the model as one batch."""
    fmt = fmt or PromptFormat.for_model(loaded)
    newline = loaded.tokenizer.encode("\n", add_special_tokens=False)
    stop_q = sorted(fmt.stop_ids | set(newline[-1:]))
    cue = loaded.tokenizer.encode(QUESTION_CUE, add_special_tokens=False)
    replies = _greedy(loaded, [fmt.prompt_ids([c], INSTRUCTION) + cue for c in chunks], max_new_tokens, stop_q)
    questions = [parse_question(r) for r in replies]
    asked = [i for i, q in enumerate(questions) if q is not None]
    out: list[tuple[str, str] | None] = [None] * len(chunks)
    if asked:
        prompts = [fmt.prompt_ids([chunks[i]], questions[i]) for i in asked]
        for i, reply in zip(asked, _greedy(loaded, prompts, max_new_tokens // 2, sorted(fmt.stop_ids))):
            a = parse_answer(reply)
            out[i] = (questions[i], a) if a is not None else None
    return out


def add_self_questions(loaded: LoadedModel, samples: Iterable[Sample], max_new_tokens: int = 32,
                       progress: Callable[[int, Sample], None] | None = None,
                       only_questions: bool = False, batch: int = 8) -> list[Sample]:
    """Each sample with a "selfq" continuation added where the model's reply parses, the
    others unchanged; with `only_questions`, just the "selfq" continuation (a sample without
    one then has no continuation, and `load_samples` skips it). `batch` chunks per pass."""
    fmt = PromptFormat.for_model(loaded)
    samples, out = list(samples), []
    for b in range(0, len(samples), batch):
        group = samples[b : b + batch]
        for s, qa in zip(group, write_questions(loaded, [s.text for s in group], max_new_tokens, fmt)):
            own = [Continuation("selfq", *qa)] if qa else []
            out.append(Sample(s.text, own if only_questions else list(s.conts) + own, s.source))
            if progress is not None:
                progress(len(out), out[-1])
    return out


def sample_to_json(s: Sample) -> str:
    return json.dumps({"text": s.text, "source": s.source,
                       "conts": [{"kind": c.kind, "question": c.question, "answer": c.answer} for c in s.conts]})


def save_samples(path: str | Path, samples: Iterable[Sample]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(sample_to_json(s) + "\n" for s in samples))
    tmp.replace(path)
    return path


def load_samples(path: str | Path) -> list[Sample]:
    """Samples written by `save_samples` (or line by line with `sample_to_json`); those
    without a continuation are left out."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            conts = [Continuation(c["kind"], c["question"], c["answer"]) for c in d["conts"]]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a sample line ({e})") from e
        if conts:
            out.append(Sample(d["text"], conts, d.get("source", "")))
    return out
