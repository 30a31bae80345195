"""Tiny offline tokenizers and random models for the engine / ingest / CLI tests.

Byte-level BPE trained in milliseconds on a few sentences (any text still encodes), a
chat variant with a ChatML template and a base variant that prepends BOS, and tiny
random causal LMs of the three real families saved as local model folders.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Context: Question: Answer: The cat sat on the mat. Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog! Is it raining? Yes, it is raining today.",
    "Alice was beginning to get very tired of sitting by her sister on the bank.",
    "In 1912 the ship sailed from Southampton to New York with 2,224 people on board.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def make_tokenizer(chat: bool = True, vocab_size: int = 384):
    """A fast byte-level BPE tokenizer; chat=True adds a ChatML template, else BOS is prepended."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    if not chat:  # base layout: BOS first, like Gemma
        bos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>" if chat else "<|endoftext|>",
        pad_token="<pad>",
    )
    if chat:
        fast.chat_template = CHATML
    return fast


def tiny_config(family: str, vocab_size: int):
    """A 2-4 layer random config of one of the real families (llama, qwen2, gemma3_text)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 2048, "tie_word_embeddings": True}  # fmt: skip
    if family == "llama":
        return LlamaConfig(num_hidden_layers=3, **common)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=2, **common)
    if family == "gemma3_text":
        return Gemma3TextConfig(
            num_hidden_layers=4, sliding_window=8, layer_types=None,
            sliding_window_pattern=2, query_pre_attn_scalar=16, **common,
        )  # fmt: skip
    raise ValueError(f"unknown family {family}")


def make_model_dir(root: Path, family: str = "llama", chat: bool = True, seed: int = 0) -> Path:
    """Save a tiny random causal LM + tokenizer to `root/<family>-<chat|base>-<seed>`."""
    from transformers import AutoModelForCausalLM

    out = root / f"{family}-{'chat' if chat else 'base'}-{seed}"
    if (out / "config.json").exists():
        return out
    tokenizer = make_tokenizer(chat=chat)
    config = tiny_config(family, vocab_size=len(tokenizer))
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the default init: sharper, more varied logits
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextmanager
def offline_home(root: Path) -> Iterator[dict[str, Any]]:
    """For CLI tests: CAGKV_HOME at `root`, the hash embedder, no hub access, and a tiny chat
    llama saved under `root/m`. Yields {"home": root, "model": its folder as str}."""
    model = make_model_dir(root / "m", "llama", chat=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAGKV_HOME", str(root))
        mp.setenv("CAGKV_EMBEDDER", "hash-64")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield {"home": root, "model": str(model)}
