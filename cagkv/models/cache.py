"""HF cache <-> position-free tensors: the one place cagkv converts to and from `DynamicCache`.

`extract_kv` reads a model's cache and un-rotates the keys with the positions they were
computed at, giving position-free K and V `[L, H, T, D]`. `build_cache` / `append_kv`
rotate position-free keys to the positions where they are placed and fill a
`DynamicCache` the model accepts through `cache=`.

Sliding-window layers (Gemma-3: `DynamicSlidingWindowLayer`) keep only the last
`window - 1` tokens but report the true length (`cumulative_length`) that masks and
position ids are derived from; `build_cache` sets it. To extract every token of a
sequence longer than the window, prefill with `full_cache()` (a config-less
`DynamicCache` that keeps every token on every layer; masks stay correct because
they are computed from absolute indices).

Example:
    >>> out = model(ids, cache=full_cache(), use_cache=True)                  # doctest: +SKIP
    >>> K, V = extract_kv(out.cache, spec, torch.arange(ids.shape[1]))        # doctest: +SKIP
    >>> cache = build_cache(model.config, spec, K, V, torch.arange(K.shape[2]))  # doctest: +SKIP
    >>> model(next_ids, cache=cache).logits                                    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from cagkv.models.rope import rotate, unrotate

if TYPE_CHECKING:
    from transformers import DynamicCache

    from cagkv.models.spec import ModelSpec


def full_cache() -> "DynamicCache":
    """An empty cache that keeps all tokens on every layer (sliding ones included)."""
    from transformers import DynamicCache

    return DynamicCache()


def full_copy(cache: Any) -> "DynamicCache":
    """A `full_cache()` holding `cache`'s entries, layer by layer (the inverse of
    `model_layout`). The tensors are shared: appending makes new ones and leaves `cache`
    as it was; clone first to write into either in place."""
    full = full_cache()
    for i, layer in enumerate(cache.layers):
        full.update(layer.keys, layer.values, i)
    return full


def model_layout(config: Any, cache: Any) -> "DynamicCache":
    """`cache` (every token on every layer, as `full_cache()` keeps them) in the layout the
    model builds for itself: sliding-window layers keep only their window. The same cache
    when the config names no per-layer kinds (then no layer trims)."""
    from transformers import DynamicCache

    out = DynamicCache(config=config)
    if len(out.layers) != len(cache.layers):
        return cache
    for src, dst in zip(cache.layers, out.layers):
        if src.keys is not None and src.keys.numel():
            dst.update(src.keys, src.values)
    return out


def layer_span(cache: Any, layer: int) -> tuple[int, int]:
    """(first absolute index held, true length) of one layer of an HF cache."""
    lay = cache.layers[layer]
    if not getattr(lay, "is_initialized", False) or lay.keys is None or lay.keys.numel() == 0:
        return 0, 0
    held = lay.keys.shape[-2]
    total = int(lay.get_seq_length())
    return total - held, total


def extract_kv(
    cache: Any,
    spec: "ModelSpec",
    positions: torch.Tensor,
    batch_index: int = 0,
    start: int | None = None,
    dtype: torch.dtype | None = None,
    layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-free (K, V), each `[L, H, T, D]`, of T consecutive cache entries.

    dtype: of the result (default: the cache's). `torch.float32` from a bf16 cache keeps
    the un-rotated keys exact, so `build_cache(..., dtype=torch.bfloat16)` at the same
    positions gives back the model's own cache bit for bit.

    positions `[T]` int64: the positions the entries were computed at (what RoPE used).
    start: absolute index (0 = the first token the cache saw) of the first entry to take;
    default: the last T entries. Raises ValueError when a sliding layer no longer holds
    them (prefill with `full_cache()` to keep every token).
    layers: only these layers, in this order (default: all); the result has len(layers) rows.
    """
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    T = positions.numel()
    if len(cache.layers) != spec.num_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, the spec {spec.num_layers}")
    ks, vs = [], []
    for i in range(spec.num_layers) if layers is None else layers:
        first, total = layer_span(cache, i)
        begin = total - T if start is None else start
        local = begin - first
        if local < 0 or begin + T > total:
            raise ValueError(
                f"layer {i} holds tokens [{first}, {total}), cannot take [{begin}, {begin + T}); "
                "a sliding-window layer keeps only its window: prefill with full_cache() to keep all"
            )
        lay = cache.layers[i]
        k = lay.keys[batch_index, :, local : local + T]  # [H, T, D]
        v = lay.values[batch_index, :, local : local + T]  # [H, T, D]
        ks.append(unrotate(k, positions, spec.rope[i], out_dtype=dtype))
        vs.append(v if dtype is None else v.to(dtype))
    return torch.stack(ks), torch.stack(vs)  # [L, H, T, D] each


def append_kv(
    cache: "DynamicCache",
    spec: "ModelSpec",
    K: torch.Tensor,
    V: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> "DynamicCache":
    """Rotate position-free K `[L, H, T, D]` (or `[L, B, H, T, D]`) to `positions` and append to `cache`.

    dtype: the model's dtype when it differs from K's (K is rotated in fp32 with the
    model's cos/sin and rounded once). Sliding layers trim to their window and add T to
    their true length, exactly as when the model itself appends. Returns the same cache.
    """
    positions = torch.as_tensor(positions, dtype=torch.long, device=K.device).reshape(-1)
    if K.shape != V.shape:
        raise ValueError(f"K and V shapes differ: {tuple(K.shape)} vs {tuple(V.shape)}")
    if K.dim() == 4:
        K, V = K.unsqueeze(1), V.unsqueeze(1)  # [L, H, T, D] -> [L, 1, H, T, D]
    if K.dim() != 5 or K.shape[0] != spec.num_layers:
        raise ValueError(
            f"expected K of shape [L={spec.num_layers}, (B,) H, T, D], got {tuple(K.shape)}"
        )
    if K.shape[2] != spec.num_kv_heads or K.shape[4] != spec.head_dim:
        raise ValueError(
            f"expected {spec.num_kv_heads} kv heads x {spec.head_dim}, got {K.shape[2]} x {K.shape[4]}"
        )
    if positions.numel() != K.shape[3]:
        raise ValueError(f"positions cover {positions.numel()} tokens, K has {K.shape[3]}")
    for i in range(spec.num_layers):
        k = rotate(K[i], positions, spec.rope[i], out_dtype=dtype)  # [B, H, T, D]
        v = V[i] if dtype is None else V[i].to(dtype)
        cache.layers[i].update(k.contiguous(), v.contiguous())
    return cache


def build_cache(
    config: Any,
    spec: "ModelSpec",
    K: torch.Tensor,
    V: torch.Tensor,
    positions: torch.Tensor,
    total_length: int | None = None,
    dtype: torch.dtype | None = None,
) -> "DynamicCache":
    """A fresh `DynamicCache` for `config` holding K, V `[L, H, T, D]` rotated at `positions`.

    total_length: the true sequence length the cache stands for (default T), which
    sliding layers report; pass it when K holds only the tail of a longer sequence.
    dtype: the model's dtype, when it differs from K's (see `append_kv`).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if len(cache.layers) != spec.num_layers:  # a config without layer info: lazily grown layers
        cache = DynamicCache()
        while len(cache.layers) < spec.num_layers:
            cache.layers.append(cache.layer_class_to_replicate())
    append_kv(cache, spec, K, V, positions, dtype=dtype)
    T = K.shape[-2]
    if total_length is not None and total_length != T:
        if total_length < T:
            raise ValueError(f"total_length {total_length} is shorter than the {T} tokens given")
        for lay in cache.layers:
            if not getattr(lay, "is_sliding", False):
                raise ValueError("total_length != T needs every layer to be a sliding-window layer")
            lay.cumulative_length = total_length
    return cache
