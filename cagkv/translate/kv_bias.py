"""A translator's mean error: one key and one value offset per target layer and KV head.

A translator trained end to end (its loss is the target's behaviour, not the keys and values
themselves) can leave an offset shared by every token it translates: attention over the
translated keys alone does not see a key offset (it adds the same logit to all of them), so
the loss barely pushes against it, but the target's question tokens weigh translated keys
against native ones (the prompt, separators, the question), and a value offset moves every
output. `fit` averages `native - translated` over chunks of held-out text, keys before RoPE;
`Translator` adds the offsets to what it translates when its folder holds `KV_BIAS_FILE`.

Measured harmful (docs/EXPERIMENTS.md E84): the offsets lower the key error by a third and
take SmolLM2 -> Gemma-3 from 86.8 % to 33.9 % answer log-prob recovery at r = 0 (Qwen2.5:
85.5 % -> 67.1 %); the question then gives the chunk even less attention against the sink.
The offset is part of what the translator learned through the target. No shipped translator
has the file; this module is kept to reproduce the measurement.

Example:
    >>> bias = fit_kv_bias(engine, "gemma3-270m", document_ids)   # doctest: +SKIP
    >>> save_kv_bias(bias, "my-translator/")                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cagkv.errors import TranslatorError

__all__ = ["KV_BIAS_FILE", "BiasAccumulator", "chunk_kv", "fit_kv_bias", "save_kv_bias", "load_kv_bias", "apply_kv_bias"]

KV_BIAS_FILE = "kv_bias.safetensors"
FIT_QUESTION = "Summarise the text."  # the question is not in the cache: any will do


class BiasAccumulator:
    """Running sums of `native - translated` per layer and head, over every token added."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.tokens = 0

    def add(self, native_keys: torch.Tensor, translated_keys: torch.Tensor, native_values: torch.Tensor,
            translated_values: torch.Tensor) -> None:
        """One chunk's keys (position-free) and values `[L, H, T, D]`, native and translated."""
        shapes = {tuple(t.shape) for t in (native_keys, translated_keys, native_values, translated_values)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 4:
            raise ValueError(f"expected four tensors of one shape [L, H, T, D], got {sorted(shapes)}")
        dk = (native_keys.float() - translated_keys.float()).sum(dim=2).cpu()
        dv = (native_values.float() - translated_values.float()).sum(dim=2).cpu()
        if self.keys is None:
            self.keys, self.values = dk, dv
        elif self.keys.shape != dk.shape:
            raise ValueError(f"chunk of layers x heads x dim {tuple(dk.shape)}, earlier ones {tuple(self.keys.shape)}")
        else:
            self.keys += dk
            self.values += dv
        self.tokens += native_keys.shape[2]

    def result(self) -> dict[str, torch.Tensor]:
        """The mean offsets `{"keys", "values"}` `[L, H, D]` and the token count."""
        if self.keys is None or self.values is None or not self.tokens:
            raise ValueError("no tokens added")
        return {"keys": self.keys / self.tokens, "values": self.values / self.tokens,
                "tokens": torch.tensor(self.tokens, dtype=torch.int64)}


def chunk_kv(prepared: Any, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 keys (RoPE removed) and values `[L, H, T, D]` of positions `first..stop-1` of a
    `Prepared` cache (`cagkv.models.cache.extract_kv`)."""
    from cagkv.models.cache import extract_kv

    return extract_kv(prepared.cache, prepared.target.spec, torch.arange(first, stop), start=first, dtype=torch.float32)


def fit_kv_bias(engine: Any, target: str, document_ids: Sequence[Any], progress: bool = False) -> dict[str, torch.Tensor]:
    """`native - translated` averaged over the first retrieved chunk of each stored document,
    through `engine`'s own path (`CAG.prepare`): its native prefill and its translation (r = 0,
    no refresh, as its translator gives it) assembled at the same positions; keys before RoPE.
    Every layer must still hold the chunk (a sliding window longer than prefix + chunk: 512
    tokens on Gemma-3 against chunks of 256); `extract_kv` says so where one does not."""
    from tqdm import tqdm

    acc = BiasAccumulator()
    for document in tqdm(document_ids, desc="native vs translated", disable=not progress):
        ask = dict(target=target, document_ids=[document], top_k=1)
        native = engine.prepare(FIT_QUESTION, mode="native", **ask)
        translated = engine.prepare(FIT_QUESTION, mode="translate", replay=0, refresh=0.0, **ask)
        first, stop = len(native.fmt.context_prefix_ids()), translated.next_position  # the chunk's tokens
        (native_k, native_v), (translated_k, translated_v) = (chunk_kv(p, first, stop) for p in (native, translated))
        acc.add(native_k, translated_k, native_v, translated_v)
    return acc.result()


def save_kv_bias(bias: dict[str, torch.Tensor], folder: str | Path) -> Path:
    """Write the offsets beside a translator's weights (`KV_BIAS_FILE`)."""
    from safetensors.torch import save_file

    path = Path(folder) / KV_BIAS_FILE
    save_file({k: v.contiguous() for k, v in bias.items()}, str(path))
    return path


def load_kv_bias(folder: str | Path, layers: int, heads: int, head_dim: int) -> dict[str, torch.Tensor] | None:
    """The offsets saved in `folder` (float32 `[layers, heads, head_dim]` keys and values), or None without a file."""
    from cagkv.translate.sidecar import read_tensors

    path = Path(folder) / KV_BIAS_FILE
    saved = read_tensors(path, ("keys", "values"), "kv bias")
    if saved is None:
        return None
    bias = {name: t.float() for name, t in saved.items()}
    want = (layers, heads, head_dim)
    for name, t in bias.items():
        if tuple(t.shape) != want or not torch.isfinite(t).all():
            raise TranslatorError(f"kv bias at {path}: {name} must be finite, of shape {list(want)} "
                                  f"(the target's layers, KV heads, head dim), got {list(t.shape)}")
    return bias


def apply_kv_bias(keys: torch.Tensor, values: torch.Tensor, bias: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-free keys and values `[L, H, T, D]` plus the offsets: added in float32, rounded
    once to the inputs' dtype."""
    bk = bias["keys"].to(device=keys.device, dtype=torch.float32)[:, :, None]
    bv = bias["values"].to(device=values.device, dtype=torch.float32)[:, :, None]
    return (keys.float() + bk).to(keys.dtype), (values.float() + bv).to(values.dtype)
