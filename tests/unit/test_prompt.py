"""PromptFormat: chat and base layouts, piecewise tokenization, stop tokens."""

from __future__ import annotations

import pytest
from engine_helpers import make_tokenizer

from cagkv.prompt import PromptFormat


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(chat=True)


@pytest.fixture(scope="module")
def base_tok():
    return make_tokenizer(chat=False)


def test_chat_layout_matches_the_template(chat_tok):
    fmt = PromptFormat.for_tokenizer(chat_tok)
    assert fmt.chat
    question, chunks = "What is the capital?", ["Paris is the capital.", "The cat sat."]
    ids = fmt.prompt_ids(chunks, question)
    content = "Context:\n" + "\n\n".join(chunks) + "\n\nQuestion: " + question
    expected = chat_tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert chat_tok.decode(ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")


def test_pieces_concatenate_to_the_prompt(chat_tok):
    fmt = PromptFormat.for_tokenizer(chat_tok)
    prefix, c1, c2, sep, suffix = (
        fmt.context_prefix_ids(), fmt.chunk_ids("One."), fmt.chunk_ids("Two."), fmt.separator_ids(),
        fmt.question_suffix_ids("Q?"),
    )  # fmt: skip
    assert fmt.prompt_ids(["One.", "Two."], "Q?") == prefix + c1 + sep + c2 + sep + suffix
    # the template's special tokens are single tokens, not spelled out
    assert chat_tok.convert_tokens_to_ids("<|im_start|>") == prefix[0]
    assert chat_tok.decode(c1) == "One." and chat_tok.decode(sep) == "\n\n"


def test_base_layout_has_bos_and_answer_cue(base_tok):
    fmt = PromptFormat.for_tokenizer(base_tok)
    assert not fmt.chat and fmt.stop_on_newline
    ids = fmt.prompt_ids(["Paris is the capital."], "  Capital?  ")
    assert ids[0] == base_tok.bos_token_id
    assert ids.count(base_tok.bos_token_id) == 1
    assert base_tok.decode(ids[1:]) == "Context:\nParis is the capital.\n\nQuestion: Capital?\nAnswer:"


def test_chat_can_be_forced_off(chat_tok):
    fmt = PromptFormat.for_tokenizer(chat_tok, chat=False)
    assert chat_tok.decode(fmt.prompt_ids([], "Q")) == "Context:\nQuestion: Q\nAnswer:"
    with pytest.raises(ValueError, match="chat template"):
        PromptFormat.for_tokenizer(make_tokenizer(chat=False), chat=True)


def test_stop_ids_include_eos_and_end_of_turn(chat_tok, base_tok):
    chat = PromptFormat.for_tokenizer(chat_tok, extra_stop_ids=[7])
    assert chat_tok.convert_tokens_to_ids("<|im_end|>") in chat.stop_ids and 7 in chat.stop_ids
    base = PromptFormat.for_tokenizer(base_tok)
    assert base_tok.eos_token_id in base.stop_ids
