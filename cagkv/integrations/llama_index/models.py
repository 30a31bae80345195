"""cagkv's local models as LlamaIndex models: a target model as an LLM, the embedder."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from cagkv.errors import UsageError


# --- LLM ------------------------------------------------------------------------------
class CagkvLLM(CustomLLM):
    """A cagkv target model as a LlamaIndex LLM (local, greedy, text only).

    `complete` / `stream_complete` continue the prompt as given; `chat` / `stream_chat`
    render the messages with the model's chat template when it has one. Set
    `Settings.llm = CagkvLLM(model="smollm2-135m")` to keep every LlamaIndex component
    on the same local models as the cache.

    Example:
        >>> llm = CagkvLLM(model="smollm2-135m", max_new_tokens=32)
        >>> print(llm.complete("The capital of France is"))
    """

    model: str = Field(description="cagkv zoo name or local folder of the model.")
    max_new_tokens: int = Field(default=256, gt=0, description="Tokens generated at most.")
    context_window: int = Field(default=2048, gt=0, description="Prompt + answer tokens.")
    _loaded: Any = PrivateAttr()

    def __init__(self, model: str, loaded: Any = None, **kwargs: Any) -> None:
        """`loaded`: an already loaded `cagkv.models.LoadedModel` (skips `cagkv.models.load`)."""
        super().__init__(model=model, **kwargs)
        if loaded is None:
            from cagkv.models import load

            loaded = load(model)
        self._loaded = loaded

    @classmethod
    def class_name(cls) -> str:
        return "CagkvLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._has_chat_template(),
            model_name=self.model,
        )

    def _has_chat_template(self) -> bool:
        return bool(getattr(self._loaded.tokenizer, "chat_template", None))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text = "".join(self._pieces(self._prompt_ids(prompt, formatted), **kwargs))
        return CompletionResponse(text=text)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        ids = self._prompt_ids(prompt, formatted)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in self._pieces(ids, **kwargs):
                text += piece
                yield CompletionResponse(text=text, delta=piece)

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if not self._has_chat_template():
            return super().chat(messages, **kwargs)
        text = "".join(self._pieces(self._chat_ids(messages), **kwargs))
        return ChatResponse(message=ChatMessage(role="assistant", content=text))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        if not self._has_chat_template():
            return super().stream_chat(messages, **kwargs)
        ids = self._chat_ids(messages)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in self._pieces(ids, **kwargs):
                text += piece
                yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta=piece)

        return gen()

    def _prompt_ids(self, prompt: str, formatted: bool) -> list[int]:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return list(self._loaded.tokenizer(prompt)["input_ids"])  # adds BOS where the model wants it

    def _chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        turns = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        rendered = self._loaded.tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=True
        )
        return list(self._loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def _pieces(self, prompt_ids: list[int], max_new_tokens: int | None = None, **_: Any) -> Iterator[str]:
        from cagkv.pipeline import generate_text

        limit = max_new_tokens or self.max_new_tokens
        if len(prompt_ids) + limit > self.context_window:
            raise UsageError(
                f"prompt of {len(prompt_ids)} tokens + {limit} new exceeds context_window "
                f"{self.context_window}"
            )
        return generate_text(self._loaded, prompt_ids, max_new_tokens=limit)


# --- embeddings -----------------------------------------------------------------------
class CagkvEmbedding(BaseEmbedding):
    """cagkv's sentence embedder (MiniLM-L6 by default) as a LlamaIndex embedding model.

    Offline: it loads the local model cagkv uses for its FAISS index, so
    `Settings.embed_model = CagkvEmbedding()` embeds exactly like the store.

    Example:
        >>> Settings.embed_model = CagkvEmbedding()
        >>> len(Settings.embed_model.get_query_embedding("hello"))
        384
    """

    model_name: str = Field(default="minilm-l6", description="cagkv embedder name or folder.")
    _embedder: Any = PrivateAttr()

    def __init__(self, model_name: str = "minilm-l6", embedder: Any = None, **kwargs: Any) -> None:
        """`embedder`: a `cagkv.stores.embed.Embedder` (e.g. a store's); else `model_name`'s."""
        if embedder is None:
            from cagkv.stores.embed import make_embedder

            embedder = make_embedder(model_name)
        super().__init__(model_name=embedder.name, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "CagkvEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embeddings([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        vectors = self._embedder.embed(list(texts))  # [N, dim], L2-normalised
        return [[float(x) for x in row] for row in vectors]
