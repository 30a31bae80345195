"""Rotary position embedding per layer: rotate position-free keys to positions and back.

The inverse frequencies and the attention scaling come from transformers' own functions
(`ROPE_INIT_FUNCTIONS` for scaled types: linear, llama3, yarn, ...; the same default
formula as the models' rotary classes), and the rotation is the models' own
`k * cos + rotate_half(k) * sin` in the keys' dtype, so `rotate` reproduces the keys a
model caches. Gemma-3 has one RopeLayer per layer type (θ 10k local, 1M global).

"dynamic" and "longrope" types change their frequencies with the sequence length at run
time; a RopeLayer holds their initial frequencies (exact up to the original context).

Shapes: keys `[..., T, D]`, positions `[T]` int64 (or broadcastable to keys' `[..., T]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass(frozen=True, eq=False)
class RopeLayer:
    """One layer's RoPE: inv_freq `[Dr/2]` (fp32) and the scaling applied to cos/sin."""

    rope_type: str
    base: float
    inv_freq: torch.Tensor
    attention_scaling: float
    head_dim: int
    layer_type: str = "full_attention"
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def rotary_dim(self) -> int:
        """Channels that rotate (the first Dr of D; the rest pass through)."""
        return 2 * self.inv_freq.numel()

    @property
    def dynamic(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    def same_as(self, other: "RopeLayer | None") -> bool:
        return (
            other is not None
            and self.attention_scaling == other.attention_scaling
            and self.head_dim == other.head_dim
            and torch.equal(self.inv_freq, other.inv_freq)
        )


def rope_layer_from_config(config: Any, layer_type: str = "full_attention") -> RopeLayer:
    """The RoPE of layers of `layer_type` in `config` (an HF config with `rope_parameters`)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params_all = getattr(config, "rope_parameters", None) or {}
    nested = isinstance(params_all.get(layer_type), dict)  # Gemma-3: one dict per layer type
    params = dict(params_all[layer_type] if nested else params_all)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10_000.0)))
    if rope_type == "default":
        # Same formula as every supported model's compute_default_rope_parameters.
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        if rope_type not in ROPE_INIT_FUNCTIONS:
            known = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
            raise ValueError(f"unknown rope_type {rope_type!r}: expected one of {known}")
        fn = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, scaling = fn(config, None, layer_type=layer_type if nested else None)
    return RopeLayer(
        rope_type=rope_type,
        base=base,
        inv_freq=inv_freq.detach().to(torch.float32).cpu(),
        attention_scaling=float(scaling),
        head_dim=head_dim,
        layer_type=layer_type,
        params=params,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(rope: RopeLayer, positions: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[..., T, Dr]` in fp32, scaled by attention_scaling, as the models compute them."""
    inv = rope.inv_freq.to(device=device or positions.device)
    freqs = positions.to(inv.device)[..., None].float() * inv  # [..., T, Dr/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, Dr]
    return emb.cos() * rope.attention_scaling, emb.sin() * rope.attention_scaling


def rotate(
    keys: torch.Tensor, positions: torch.Tensor, rope: RopeLayer | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Apply RoPE at `positions` to position-free keys `[..., T, D]` (identity when rope is None).

    By default computed as the model does, in the keys' dtype. With `out_dtype` (e.g. fp32
    keys for a bf16 model) it is computed in fp32 with the cos/sin the model uses in
    `out_dtype` and rounded once at the end: the exact inverse of `unrotate(..., out_dtype=fp32)`.
    """
    if rope is None:
        return keys if out_dtype is None else keys.to(out_dtype)
    _check(keys, positions, rope)
    cos, sin = cos_sin(rope, positions, keys.device)
    rd = rope.rotary_dim
    if out_dtype is None or out_dtype == keys.dtype:
        cos, sin = cos.to(keys.dtype), sin.to(keys.dtype)  # the models cast cos/sin to the keys' dtype
        k = keys[..., :rd]
        out = (k * cos) + (_rotate_half(k) * sin)
        return out if rd == keys.shape[-1] else torch.cat((out, keys[..., rd:]), dim=-1)
    cos, sin = cos.to(out_dtype).float(), sin.to(out_dtype).float()
    k = keys[..., :rd].float()
    out = ((k * cos) + (_rotate_half(k) * sin)).to(out_dtype)
    return out if rd == keys.shape[-1] else torch.cat((out, keys[..., rd:].to(out_dtype)), dim=-1)


def unrotate(
    keys: torch.Tensor, positions: torch.Tensor, rope: RopeLayer | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Remove RoPE applied at `positions` from keys `[..., T, D]`.

    Computed in fp32, returned in `out_dtype` (default: the keys' dtype). For bf16 keys,
    `out_dtype=torch.float32` keeps the exact inverse (no second rounding).
    """
    out_dtype = out_dtype or keys.dtype
    if rope is None:
        return keys.to(out_dtype)
    _check(keys, positions, rope)
    cos, sin = cos_sin(rope, positions, keys.device)
    # Invert the map the model applied: cos/sin rounded to the keys' dtype (bf16 rounding makes
    # it slightly non-orthogonal) and scaled by attention_scaling, so divide by cos^2 + sin^2.
    cos, sin = cos.to(keys.dtype).float(), sin.to(keys.dtype).float()
    rd = rope.rotary_dim
    k = keys[..., :rd].float()
    out = (((k * cos) - (_rotate_half(k) * sin)) / (cos * cos + sin * sin)).to(out_dtype)
    return out if rd == keys.shape[-1] else torch.cat((out, keys[..., rd:].to(out_dtype)), dim=-1)


def rotate_layers(
    keys: torch.Tensor, positions: torch.Tensor, ropes: Sequence[RopeLayer | None], out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """rotate() per layer: keys `[L, ..., T, D]` with one RopeLayer (or None) per layer."""
    assert keys.shape[0] == len(ropes), (tuple(keys.shape), len(ropes))
    return torch.stack([rotate(keys[i], positions, r, out_dtype) for i, r in enumerate(ropes)])


def unrotate_layers(
    keys: torch.Tensor, positions: torch.Tensor, ropes: Sequence[RopeLayer | None], out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """unrotate() per layer: keys `[L, ..., T, D]` with one RopeLayer (or None) per layer.

    From a bf16 model's cache, pass the keys as they are (not `.float()`) with
    `out_dtype=torch.float32`: the inverse then uses the model's own bf16 cos/sin.
    """
    assert keys.shape[0] == len(ropes), (tuple(keys.shape), len(ropes))
    return torch.stack([unrotate(keys[i], positions, r, out_dtype) for i, r in enumerate(ropes)])


def _check(keys: torch.Tensor, positions: torch.Tensor, rope: RopeLayer) -> None:
    if keys.shape[-1] != rope.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]}, expected {rope.head_dim}")
    if positions.shape[-1] != keys.shape[-2]:
        raise ValueError(f"positions cover {positions.shape[-1]} tokens, keys have {keys.shape[-2]}")
    if positions.is_floating_point():
        raise ValueError(f"positions must be integers, got {positions.dtype}")
