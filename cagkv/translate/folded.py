"""The translator folded for inference: everything linear after the mixture in one GEMM per layer.

Training reads `MoTTranslator.forward` (outputs in normalised units, where its losses
live) and `assemble_kv`. At inference each translated layer's keys and values are an affine
function of one design row per token,

    [raw source features of the layer's mapped source layers | RMS-normed target embedding
     | the layer group's head-normed state]

because the source normalisation, the linear path (`skip`), the layer's head, the target
units (`decode`) and the k-norm's per-channel scale (`TargetSide.k_post`) are all linear.
`FoldedMoT` multiplies them into one matrix and bias per layer and applies them as one
batched GEMM over the layers on a design built in layer-major order, so the output is
already in the target's units and layout: a dozen passes over `[B, Lt, T, 2kv]` (gathers,
casts, a permuting einsum, adds, decode, stacking) become one copy in and one copy out.
The groups' input projections take the source normalisation into their weights too.

What stays outside: the sequence mixing and experts (not linear), layer 0 (computed exactly
from the embeddings), the target's k-norm itself (a division by the key's length) and the
learned key scales. Translators with `layer_streams` are not folded (`FoldedMoT.supports`).

Example:
    >>> folded = FoldedMoT(mot, TargetSide(target.model), torch.bfloat16)
    >>> kv, hidden = folded.kv(inputs, emb)   # per block (keys, values) [L, H, T_b, D]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cagkv.translate.features import TargetSide
from cagkv.translate.mot import MoTTranslator

if TYPE_CHECKING:
    from cagkv.translate.translator import TranslateInputs

__all__ = ["FoldedMoT"]


class FoldedMoT:
    """Inference-only folded copy of a `MoTTranslator`'s linear parts for one target (see module doc)."""

    def __init__(self, mot: MoTTranslator, ts: TargetSide, dtype: torch.dtype = torch.float32) -> None:
        if not self.supports(mot):
            raise ValueError("translators with layer_streams are not folded")
        cfg = mot.cfg
        self.mot, self.ts, self.dtype = mot, ts, dtype
        with torch.no_grad():
            inv_std = 1.0 / mot.src_std
            shift = mot.src_mean * inv_std  # normalised = raw * inv_std - shift
            self.in_proj = []
            for g in range(len(cfg.groups)):
                cols = getattr(mot, f"cols_{g}")
                lin = mot.in_proj[g]
                self.in_proj.append((lin.weight * inv_std[cols], lin.bias - lin.weight @ shift[cols]))
            self.weight, self.bias, self.source_layers = self._fold_layers(inv_std, shift)

    @staticmethod
    def supports(mot: MoTTranslator) -> bool:
        return not mot.cfg.layer_streams

    def _fold_layers(self, inv_std: torch.Tensor, shift: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per translated layer the design's matrix `[Lt, F, 2kv]` and bias `[Lt, 2kv]` (target
        units, keys divided by the k-norm scale), and the source-layer positions its design
        reads `[Lt, n_map]` (None without a linear path)."""
        mot, cfg = self.mot, self.mot.cfg
        parts, bias = [], mot.head_b.clone()
        source_layers = None
        if cfg.skip_rank > 0:
            feat = 2 * cfg.src_kv_dim
            n_emb = cfg.tgt_embed_dim
            w = torch.bmm(mot.skip_a, mot.skip_b)  # [Lt, F_src + E, 2kv] on normalised inputs
            w_src, w_emb = w[:, :-n_emb], w[:, -n_emb:]
            cols = mot.skip_cols  # [Lt, F_src]
            parts += [w_src * inv_std[cols][:, :, None], w_emb]
            bias = bias + mot.skip_bias - torch.einsum("lf,lfo->lo", shift[cols], w_src)
            source_layers = cols[:, ::feat] // feat
        parts.append(mot.head_w)  # [Lt, d, 2kv] on the head-normed group state
        weight = torch.cat(parts, 1)
        idx = torch.tensor(cfg.translated)
        std, mean = mot.tgt_std[idx], mot.tgt_mean[idx]  # [Lt, 2kv]: decode
        post = std.clone()
        mean = mean.clone()
        if cfg.tgt_k_norm:  # k_post divides keys by the norm's per-channel scale before the norm
            kv = cfg.tgt_kv_dim
            for i, layer in enumerate(cfg.translated):
                scale = self.ts.k_scale(layer).float()
                scale = torch.where(scale.abs() < 1e-4, torch.full_like(scale, 1e-4), scale)
                tiled = scale.repeat(cfg.tgt_kv_heads)  # key channels are laid out head by head
                post[i, :kv] /= tiled
                mean[i, :kv] /= tiled
        weight = (weight * post[:, None, :]).to(self.dtype).contiguous()
        return weight, bias * post + mean, source_layers

    def design(self, src: torch.Tensor, emb: torch.Tensor, head_states: torch.Tensor) -> torch.Tensor:
        """`[Lt, B*T, F]` design from raw source features `[B, T, F_all]`, embeddings `[B, T, E]`
        and head-normed group states `[G, B, T, d]`, in the folded dtype."""
        cfg = self.mot.cfg
        b, t, _ = src.shape
        n_tr, f = self.weight.shape[:2]
        out = torch.empty(n_tr, b * t, f, dtype=self.dtype)
        at = 0
        if self.source_layers is not None:
            feat = 2 * cfg.src_kv_dim
            per_layer = src.reshape(b * t, -1, feat)  # [BT, n_used, feat]
            for i, row in enumerate(self.source_layers.tolist()):
                for j, s in enumerate(row):
                    out[i, :, at + j * feat : at + (j + 1) * feat].copy_(per_layer[:, s])
            at += self.source_layers.shape[1] * feat
            e = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)
            out[:, :, at : at + e.shape[-1]].copy_(e.reshape(1, b * t, -1).expand(n_tr, -1, -1))
            at += e.shape[-1]
        group_of = {layer: g for g, layers in enumerate(cfg.groups) for layer in layers}
        for i, layer in enumerate(cfg.translated):
            out[i, :, at:].copy_(head_states[group_of[layer]].reshape(b * t, -1))
        return out

    @torch.no_grad()
    def kv(self, inputs: TranslateInputs, emb: torch.Tensor, out_dtype: torch.dtype = torch.float32
           ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Keys and values `[L, H, T_b, D]` (position-free, `out_dtype`) of each block of
        `inputs`, and the groups' states `[G, B, T, d]` (`MoTOutput.hidden`, which expert-fed
        replay heads read); `emb` `[B, T, E]` float32 target embeddings of its ids."""
        mot, cfg, ts = self.mot, self.mot.cfg, self.ts
        h, _, _ = mot.mixture(inputs.src, emb, inputs.mask, in_proj=self.in_proj)
        head_states = torch.stack([mot.head_norm[g](h[g]) for g in range(h.shape[0])])
        # the bias is added in float32 on the way out: with a bfloat16 product, adding the
        # target's means (large on some key channels) before rounding would cost precision
        y = torch.bmm(self.design(inputs.src, emb, head_states), self.weight)
        b, t = inputs.ids.shape
        heads, d, kv = cfg.tgt_kv_heads, cfg.tgt_head_dim, cfg.tgt_kv_dim
        y = y.view(-1, b, t, 2 * kv)  # [Lt, B, T, 2kv]
        k0, v0 = ts.exact_kv(emb.to(next(ts.model.parameters()).dtype), 0)  # [B, H, T, D]
        scales = mot.key_scales()
        result = []
        for i, n in enumerate(inputs.lengths):
            keys = torch.empty(cfg.tgt_layers, heads, n, d, dtype=out_dtype)
            values = torch.empty_like(keys)
            for layer in cfg.exact_layers:
                keys[layer], values[layer] = k0[i, :, :n], v0[i, :, :n]
            for j, layer in enumerate(cfg.translated):
                bias = self.bias[j].view(2 * heads, 1, d)
                torch.add(y[j, i, :n, :kv].view(n, heads, d).transpose(0, 1), bias[:heads], out=keys[layer])
                torch.add(y[j, i, :n, kv:].view(n, heads, d).transpose(0, 1), bias[heads:], out=values[layer])
                if cfg.tgt_k_norm:
                    norm = ts.layers[layer].self_attn.k_norm
                    keys[layer] = norm(keys[layer].to(next(norm.parameters()).dtype)).to(out_dtype)
                if scales is not None:
                    keys[layer] *= scales[layer].to(out_dtype)
            result.append((keys, values))
        return result, h
