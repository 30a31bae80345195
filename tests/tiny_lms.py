"""Tiny random models for every supported family, built from configs (no files).

A module of its own (not conftest) so test files can import it by a unique name.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_FAMILIES = ("llama", "qwen2", "gemma3_text", "gpt2")
ROPE_FAMILIES = ("llama", "qwen2", "gemma3_text")
REAL_LMS = ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")


@dataclass
class TinyLM:
    model: Any
    config: Any
    spec: Any
    family: str


def tiny_config(family: str, **overrides: Any) -> Any:
    """A small config of `family`, with weights initialised large enough that positions matter."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )

    def rope(theta: float) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": theta}

    families = {
        "llama": (LlamaConfig, dict(common, num_hidden_layers=3, rope_parameters=rope(10000.0))),
        "qwen2": (Qwen2Config, dict(common, num_hidden_layers=3, rope_parameters=rope(1000000.0))),
        "gemma3_text": (Gemma3TextConfig, dict(
            common,
            num_hidden_layers=4,
            num_key_value_heads=1,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": rope(10000.0), "full_attention": rope(1000000.0)},
            query_pre_attn_scalar=16,
        )),
        "gpt2": (GPT2Config, dict(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                  initializer_range=0.2)),
    }
    if family in families:
        cls, kw = families[family]
        return cls(**{**kw, **overrides})
    raise ValueError(f"unknown tiny family {family!r}: expected one of {TINY_FAMILIES}")


def build_tiny(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> TinyLM:
    from transformers import AutoModelForCausalLM

    from cagkv.models import ModelSpec

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    # dtype= (not .to(dtype)) keeps the RoPE inv_freq buffers in fp32, as from_pretrained does.
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=dtype
    ).eval()
    model.requires_grad_(False)
    return TinyLM(model, model.config, ModelSpec.from_config(model.config), family)


@functools.cache
def tiny(family: str) -> TinyLM:
    """The session-wide tiny model of `family` (do not mutate it)."""
    return build_tiny(family)


def capture_pre_rope_keys(
    model: Any, family: str, ids: torch.Tensor, **forward_kwargs: Any
) -> tuple[list[torch.Tensor], Any]:
    """Run the model on `ids` and return (per-layer keys `[B, H, T, D]` before RoPE, output).

    Hooks read k_proj (after k_norm for Gemma-3), i.e. exactly what the model rotates.
    """
    layers = model.model.layers
    keys: list[torch.Tensor] = [None] * len(layers)  # type: ignore[list-item]
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if family == "gemma3_text":

            def hook(mod, inp, out, i=i):  # k_norm output is already [B, H, T, D]
                keys[i] = out.detach().clone()

            hooks.append(attn.k_norm.register_forward_hook(hook))
        else:

            def hook(mod, inp, out, i=i, attn=attn):
                B, T, _ = out.shape
                keys[i] = (
                    out.detach().view(B, T, -1, attn.head_dim).transpose(1, 2).clone()
                )  # [B,T,H*D] -> [B,H,T,D]

            hooks.append(attn.k_proj.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return keys, out
