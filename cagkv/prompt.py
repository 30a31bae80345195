"""How a question and retrieved chunks become token ids, per model.

The assembled prompt is token pieces, tokenized separately and concatenated:

    context_prefix_ids()            BOS / chat header / "Context:\n"   (computed natively)
    chunk_ids(text)                 "<chunk text>"                     (a stored KV block)
    separator_ids()                 "\n\n" after every chunk            (computed natively)
    question_suffix_ids(question)   "Question: <q>" + end of turn / "\nAnswer:"

Instruct models (a chat template is present) get one user message
``Context:\n<chunks>\n\nQuestion: <q>`` with the assistant turn opened; base models get
the plain layout ``Context:\n<chunks>\n\nQuestion: <q>\nAnswer:``. A stored block
covers exactly `chunk_ids(text)`, so `native` prefill of `prompt_ids(...)` is the very
token sequence that `canonical` mode assembles from stored blocks.

Example:
    >>> fmt = PromptFormat.for_model(loaded)
    >>> ids = fmt.prompt_ids(["Paris is the capital of France."], "What is the capital?")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cagkv.models import LoadedModel

CHUNK_SEPARATOR = "\n\n"
CONTEXT_HEADER = "Context:\n"
QUESTION_HEADER = "Question: "
BASE_ANSWER_CUE = "\nAnswer:"

# Rendered into the chat template, then split on, to find where documents and question go.
_DOCS = "@@CAGKV_DOCUMENTS@@"
_QUESTION = "@@CAGKV_QUESTION@@"

# End-of-turn tokens of common chat formats; used as stop tokens when present in the vocab.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>")


@dataclass(frozen=True)
class PromptFormat:
    """The prompt layout of one model: prefix, per-chunk and suffix token ids, stop tokens.

    Args:
        tokenizer: the model's (fast) tokenizer.
        chat: True for the chat-template layout, False for the base-model layout.
        prefix_text: text before the first chunk (template header + "Context:\\n").
        suffix_head: text between the last chunk and the question ("Question: ").
        suffix_tail: text after the question (end of turn + assistant header, or "\\nAnswer:").
        special_prefix: token ids the tokenizer puts first on its own (BOS), base layout only.
        stop_ids: token ids that end an answer.
    """

    tokenizer: Any
    chat: bool
    prefix_text: str
    suffix_head: str
    suffix_tail: str
    special_prefix: tuple[int, ...] = ()
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    chunk_separator: str = CHUNK_SEPARATOR

    # --- construction ------------------------------------------------------------------
    @classmethod
    def for_model(cls, loaded: LoadedModel, chat: bool | None = None) -> PromptFormat:
        """The format of a loaded model (chat template if it has one, else base layout)."""
        gen_cfg = getattr(loaded.model, "generation_config", None)
        extra = _as_id_list(getattr(gen_cfg, "eos_token_id", None))
        return cls.for_tokenizer(loaded.tokenizer, chat=chat, extra_stop_ids=extra)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, chat: bool | None = None, extra_stop_ids: Sequence[int] = ()
    ) -> PromptFormat:
        """The format for a tokenizer; `chat=None` picks the chat layout iff a template exists."""
        has_template = bool(getattr(tokenizer, "chat_template", None))
        use_chat = has_template if chat is None else chat
        if use_chat and not has_template:
            raise ValueError("chat=True needs a tokenizer with a chat template")
        stop = set(extra_stop_ids) | set(_as_id_list(tokenizer.eos_token_id))
        stop |= _end_of_turn_ids(tokenizer)
        if use_chat:
            content = f"{CONTEXT_HEADER}{_DOCS}{QUESTION_HEADER}{_QUESTION}"
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            if not isinstance(rendered, str) or _DOCS not in rendered or _QUESTION not in rendered:
                raise ValueError("the chat template dropped the prompt placeholders")
            prefix_text, rest = rendered.split(_DOCS, 1)
            suffix_head, suffix_tail = rest.split(_QUESTION, 1)
            return cls(tokenizer, True, prefix_text, suffix_head, suffix_tail, (), frozenset(stop))
        return cls(
            tokenizer,
            False,
            CONTEXT_HEADER,
            QUESTION_HEADER,
            BASE_ANSWER_CUE,
            tuple(_special_prefix(tokenizer)),
            frozenset(stop),
        )

    # --- token pieces ----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of text, no special tokens added (template tokens parse)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def context_prefix_ids(self) -> list[int]:
        """Tokens before the documents: BOS / chat header / "Context:\\n"."""
        return list(self.special_prefix) + self.encode(self.prefix_text)

    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of one chunk as placed in the prompt (what its stored block covers)."""
        return self.encode(text)

    def separator_ids(self) -> list[int]:
        """Token ids that follow every chunk (the target computes them natively)."""
        return self.encode(self.chunk_separator)

    def question_suffix_ids(self, question: str) -> list[int]:
        """Tokens after the documents up to where the answer starts."""
        return self.encode(self.suffix_head + question.strip() + self.suffix_tail)

    def prompt_ids(self, chunk_texts: Sequence[str], question: str) -> list[int]:
        """The whole native prompt: prefix + every chunk + suffix."""
        ids = self.context_prefix_ids()
        for text in chunk_texts:
            ids += self.chunk_ids(text) + self.separator_ids()
        return ids + self.question_suffix_ids(question)

    @property
    def stop_on_newline(self) -> bool:
        """Base models keep writing "Question: ..." after their answer: stop at the line end."""
        return not self.chat


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = set()
    for token in _END_OF_TURN:  # convert_tokens_to_ids: no full-vocab dict (Gemma has 262k)
        i = tokenizer.convert_tokens_to_ids(token)
        if isinstance(i, int) and i != tokenizer.unk_token_id and tokenizer.convert_ids_to_tokens(i) == token:
            ids.add(i)
    return ids


def _special_prefix(tokenizer: Any) -> list[int]:
    """Ids the tokenizer prepends by itself (e.g. BOS), found by encoding with and without."""
    probe = "Context"
    with_special = list(tokenizer(probe)["input_ids"])
    without = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for start in range(len(with_special) - len(without) + 1):
        if with_special[start : start + len(without)] == without:
            return with_special[:start]
    return []
