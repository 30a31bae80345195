"""Translator inputs and target-side pieces that need no prefill.

- `source_features`: a source block's position-free K and V of the used layers, laid
  out per token as `[K_l | V_l]` for each used layer l, `[S, n_used * 2 * src_kv]`.
- `TargetSide`: the target's token embeddings, its layer 0 computed exactly from them
  (keys/values of layer 0 depend only on the token), and its k-norm, applied to the
  translator's pre-norm keys.

Example:
    >>> ts = TargetSide(target.model)
    >>> emb = ts.embed(ids[None])            # [1, T, E]
    >>> k0, v0 = ts.exact_kv(emb, 0)         # [1, H, T, D] each, position-free
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["source_features", "unit_rms", "TargetSide", "running_stats"]


def source_features(keys: torch.Tensor, values: torch.Tensor, used: list[int]) -> torch.Tensor:
    """`[Ls, H, S, D]` keys/values -> `[S, n_used * 2 * H * D]` float32 features."""
    _, h, s, d = keys.shape
    out = torch.empty(s, len(used), 2, h, d, dtype=torch.float32, device=keys.device)
    for j, layer in enumerate(used):  # one strided copy per layer and side: no intermediate copies
        out[:, j, 0].copy_(keys[layer].transpose(0, 1))  # [S, H, D]
        out[:, j, 1].copy_(values[layer].transpose(0, 1))
    return out.view(s, -1)  # [S, n*2*kv]


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    """`x` scaled to unit RMS over its last axis: how the linear path, the replay heads and
    the linear map read the target's embedding."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise TypeError(f"cannot find decoder layers in {type(model).__name__}")
    return inner


class TargetSide:
    """The parts of a (frozen) target model the translator uses without a prefill."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = _decoder(model).layers
        self.embed_tokens = model.get_input_embeddings()
        attn0 = self.layers[0].self_attn
        cfg = model.config
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.num_layers = len(self.layers)
        self.has_k_norm = getattr(attn0, "k_norm", None) is not None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`[B, T]` ids -> `[B, T, E]` input embeddings (with any model-specific scaling)."""
        return self.embed_tokens(ids)

    def exact_kv(self, emb: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer-0 keys/values `[B, H, T, D]` from embeddings `[B, T, E]` (position-free)."""
        if layer != 0:
            raise ValueError(f"only layer 0 is a function of the token alone, got layer {layer}")
        block = self.layers[0]
        attn = block.self_attn
        x = block.input_layernorm(emb)
        b, t, _ = x.shape
        k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim)  # [B, T, H, D]
        v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.has_k_norm:
            k = attn.k_norm(k)
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]

    def k_scale(self, layer: int) -> torch.Tensor | None:
        """Per-channel multiplier `[D]` of the layer's k-norm (its output on a unit-RMS vector)."""
        if not self.has_k_norm:
            return None
        norm = self.layers[layer].self_attn.k_norm
        ref = next(norm.parameters())
        with torch.no_grad():
            return norm(torch.ones(1, self.head_dim, dtype=ref.dtype, device=ref.device))[0].float()

    def k_divisor(self, layer: int) -> torch.Tensor:
        """`k_scale(layer)` with near-zero channels raised to 1e-4: what translator keys in
        post-norm units are divided by before the norm (`k_post`, `FoldedMoT`)."""
        scale = self.k_scale(layer)
        return torch.where(scale.abs() < 1e-4, torch.full_like(scale, 1e-4), scale)

    def k_post(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        """Translator keys `[B, H, T, D]` in post-norm units -> the target's k-norm applied.

        Dividing by the norm's per-channel scale gives the unit-RMS pre-weight vector,
        whose norm is then exactly the native one; identity for targets without k-norm.
        """
        if not self.has_k_norm:
            return k
        norm = self.layers[layer].self_attn.k_norm
        scale = self.k_divisor(layer).to(k.dtype)
        w_dtype = next(norm.parameters()).dtype
        return norm((k / scale).to(w_dtype)).to(k.dtype)


def running_stats(chunks: list[torch.Tensor], eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over rows of `[N_i, F]` tensors (float64 accumulation), std floored."""
    n, s, ss = 0, None, None
    for x in chunks:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        s = x.sum(0) if s is None else s + x.sum(0)
        ss = (x * x).sum(0) if ss is None else ss + (x * x).sum(0)
        n += x.shape[0]
    if n == 0 or s is None or ss is None:
        raise ValueError("no rows to compute statistics from")
    mean = s / n
    var = (ss / n - mean * mean).clamp(min=0)
    std = var.sqrt()
    floor = max(eps, float(std.mean()) * 1e-2)
    return mean.float(), std.clamp(min=floor).float()

