"""Self-written questions: parsing, the two native passes, sample files, pairs from a file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from translate_fixtures import CORPUS, tiny_model  # noqa: E402

from cagkv.translate import selfqa  # noqa: E402
from cagkv.translate.corpus import Continuation, Sample  # noqa: E402
from cagkv.translate.train import TrainConfig  # noqa: E402


def test_parse_question_and_answer() -> None:
    assert selfqa.parse_question(" What is the New York Supreme Court?\nA: x") == "What is the New York Supreme Court?"
    assert selfqa.parse_question("Who  wrote the book? And when?") == "Who wrote the book?"  # cut after the first "?"
    assert selfqa.parse_question("What is it?") is None  # under 4 words
    assert selfqa.parse_question("No question here.\nWhat is on line two?") is None  # first line only
    assert selfqa.parse_answer("\n The highest court.\nMore text") == "The highest court."
    long = " ".join(f"w{i}" for i in range(30))
    assert selfqa.parse_answer(long) == " ".join(f"w{i}" for i in range(selfqa.MAX_ANSWER_WORDS))
    assert selfqa.parse_answer(" \n ") is None


def test_write_questions_asks_then_answers_natively(monkeypatch) -> None:
    loaded = tiny_model("llama", 4)
    fmt = selfqa.PromptFormat.for_model(loaded)
    calls = []
    replies = iter([[" What does the river carry to the sea?\n", "no question mark here\n"], ["\nSand and silt.\n"]])

    def fake_greedy(model, prompts, max_new_tokens, stop):  # noqa: ANN001
        calls.append(prompts)
        return next(replies)

    monkeypatch.setattr(selfqa, "_greedy", fake_greedy)
    chunks = [CORPUS[2], CORPUS[0]]
    out = selfqa.write_questions(loaded, chunks, fmt=fmt)
    q = "What does the river carry to the sea?"
    assert out == [(q, "Sand and silt."), None]
    cue = loaded.tokenizer.encode(selfqa.QUESTION_CUE, add_special_tokens=False)
    assert calls[0] == [fmt.prompt_ids([c], selfqa.INSTRUCTION) + cue for c in chunks]  # read natively, then the cue
    assert calls[1] == [fmt.prompt_ids([chunks[0]], q)]  # only the parsed question is answered, in ask's layout


def test_batched_greedy_replies_match_one_by_one() -> None:
    import torch

    torch.manual_seed(0)
    loaded = tiny_model("llama", 4)
    fmt = selfqa.PromptFormat.for_model(loaded)
    prompts = [fmt.prompt_ids([CORPUS[0]], "Why?"), fmt.prompt_ids([CORPUS[1] + " " + CORPUS[2]], "What is it about?")]
    assert len(prompts[0]) != len(prompts[1])  # so the batch is left-padded
    stop = sorted(fmt.stop_ids)
    together = selfqa._greedy(loaded, prompts, 6, stop)
    assert together == [selfqa._greedy(loaded, [p], 6, stop)[0] for p in prompts]


def test_add_self_questions_and_sample_files(tmp_path: Path, monkeypatch) -> None:
    answers = iter([[("Where do rivers flow to?", "the sea")], [None]])
    monkeypatch.setattr(selfqa, "write_questions", lambda *a, **k: next(answers))
    monkeypatch.setattr(selfqa.PromptFormat, "for_model", classmethod(lambda cls, loaded: None))
    quoting = Continuation("blank", 'Fill in the blank: "Rivers flow to the ___."', "sea")
    samples = [Sample(CORPUS[2], [quoting], "d2"), Sample(CORPUS[0], [quoting], "d0")]
    seen = []
    only = selfqa.add_self_questions(object(), samples, progress=lambda i, s: seen.append(i), only_questions=True,
                                     batch=1)
    assert seen == [1, 2]
    assert only[0].conts == [Continuation("selfq", "Where do rivers flow to?", "the sea")] and only[1].conts == []
    answers = iter([[("Where do rivers flow to?", "the sea"), None]])
    both = selfqa.add_self_questions(object(), samples, batch=2)
    assert both[0].conts == [quoting, only[0].conts[0]] and both[1].conts == [quoting]
    path = selfqa.save_samples(tmp_path / "s.jsonl", only)
    back = selfqa.load_samples(path)
    assert back == [only[0]]  # the sample without a continuation is left out
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match="s.jsonl:3"):
        selfqa.load_samples(path)


def test_pairs_from_a_samples_file(tmp_path: Path, monkeypatch) -> None:
    from cagkv.errors import UsageError
    from cagkv.translate import runner

    monkeypatch.setenv("CAGKV_HOME", str(tmp_path / "home"))
    src, tgt = tiny_model("llama", 4), tiny_model("gemma3", 6)
    samples = [Sample(CORPUS[i], [Continuation("selfq", f"What does text {i} say first?", CORPUS[i].split()[0])],
                      f"doc{i}") for i in range(5)]
    path = selfqa.save_samples(tmp_path / "q.jsonl", samples)
    cfg = dict(topk=8, predict=5, heldout_share=0.3, samples=4)
    train, held, data = runner.prepare_pairs(src, tgt, TrainConfig(samples_file=str(path), **cfg))
    assert len(train) + len(held) == 4 and data["samples_file"] == str(path)
    kinds = {k for rec in list(train) + list(held) for k in rec["kinds"]}
    assert kinds == {"selfq"}
    with pytest.raises(UsageError, match="no such file"):
        runner.prepare_pairs(src, tgt, TrainConfig(samples_file=str(tmp_path / "none.jsonl"), **cfg))
