"""The translator folded for inference: everything linear after the mixture in one GEMM per layer.

Training reads `MoTTranslator.forward` (outputs in normalised units, where its losses
live) and `assemble_kv`. At inference each translated layer's keys and values are an affine
function of the token's

    [raw source features of the layer's mapped source layers | the layer group's head-normed
     state] and its RMS-normed target embedding

because the source normalisation, the linear path (`skip`), the layer's head, the target
units (`decode`) and the k-norm's per-channel scale (`TargetSide.k_post`) are all linear.
`FoldedMoT` multiplies them into one matrix and bias per layer and applies them as one
batched GEMM over the layers, on the real tokens only (the mixture before it needs the
padded batch; nothing after it does), with a design built in layer-major order. The
embedding's share depends on the token alone: it is computed once per distinct token and
enters the GEMM with the bias as its addend. The output is already in the target's units
and layout: a dozen passes over `[B, Lt, T, 2kv]` (gathers, casts, a permuting einsum,
adds, decode, stacking) become one copy in and one copy out. The groups' input projections
take the source normalisation into their weights too, and multiply in the folded dtype.

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

from cagkv.translate.features import TargetSide, unit_rms
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
                self.in_proj.append(((lin.weight * inv_std[cols]).to(dtype),
                                     (lin.bias - lin.weight @ shift[cols]).to(dtype)))
            self.weight, self.emb_weight, self.bias, self.source_layers = self._fold_layers(inv_std, shift)

    @staticmethod
    def supports(mot: MoTTranslator) -> bool:
        return not mot.cfg.layer_streams

    def _fold_layers(self, inv_std: torch.Tensor, shift: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Per translated layer the design's matrix `[Lt, F, 2kv]`; the embedding's share of
        every layer as one matrix `[E, Lt * 2kv]` (it depends on the token alone, so it is
        computed once per distinct token; None without a linear path); the bias `[Lt, 2kv]`
        (all in target units, keys divided by the k-norm scale); and the source-layer
        positions the design reads `[Lt, n_map]` (None without a linear path)."""
        mot, cfg = self.mot, self.mot.cfg
        parts, bias = [], mot.head_b.clone()
        source_layers = emb_weight = None
        if cfg.skip_rank > 0:
            feat = 2 * cfg.src_kv_dim
            n_emb = cfg.tgt_embed_dim
            w = torch.bmm(mot.skip_a, mot.skip_b)  # [Lt, F_src + E, 2kv] on normalised inputs
            w_src, emb_weight = w[:, :-n_emb], w[:, -n_emb:]
            cols = mot.skip_cols  # [Lt, F_src]
            parts.append(w_src * inv_std[cols][:, :, None])
            bias = bias + mot.skip_bias - torch.einsum("lf,lfo->lo", shift[cols], w_src)
            source_layers = cols[:, ::feat] // feat
        parts.append(mot.head_w)  # [Lt, d, 2kv] on the head-normed group state
        weight = torch.cat(parts, 1)
        idx = torch.tensor(cfg.translated, device=mot.tgt_std.device)
        std, mean = mot.tgt_std[idx], mot.tgt_mean[idx]  # [Lt, 2kv]: decode
        post = std.clone()
        mean = mean.clone()
        if cfg.tgt_k_norm:  # k_post divides keys by the norm's per-channel scale before the norm
            kv = cfg.tgt_kv_dim
            for i, layer in enumerate(cfg.translated):
                tiled = self.ts.k_divisor(layer).float().repeat(cfg.tgt_kv_heads)  # key channels are laid out head by head
                post[i, :kv] /= tiled
                mean[i, :kv] /= tiled
        weight = (weight * post[:, None, :]).to(self.dtype).contiguous()
        if emb_weight is not None:  # [Lt, E, 2kv] -> [E, Lt * 2kv]
            emb_weight = (emb_weight * post[:, None, :]).transpose(0, 1).reshape(cfg.tgt_embed_dim, -1)
            emb_weight = emb_weight.to(self.dtype).contiguous()
        return weight, emb_weight, bias * post + mean, source_layers

    def design(self, src: torch.Tensor, head_states: torch.Tensor) -> torch.Tensor:
        """`[Lt, N, F]` design of N tokens from their raw source features `[N, F_all]` and
        head-normed group states `[G, N, d]`, in the folded dtype."""
        cfg = self.mot.cfg
        n_tokens = src.shape[0]
        n_tr, f = self.weight.shape[:2]
        out = torch.empty(n_tr, n_tokens, f, dtype=self.dtype, device=src.device)
        at = 0
        if self.source_layers is not None:
            feat = 2 * cfg.src_kv_dim
            per_layer = src.view(n_tokens, -1, feat)  # [N, n_used, feat]
            for i, row in enumerate(self.source_layers.tolist()):
                for j, s in enumerate(row):
                    out[i, :, at + j * feat : at + (j + 1) * feat].copy_(per_layer[:, s])
            at += self.source_layers.shape[1] * feat
        group_of = {layer: g for g, layers in enumerate(cfg.groups) for layer in layers}
        for i, layer in enumerate(cfg.translated):
            out[i, :, at:].copy_(head_states[group_of[layer]])
        return out

    @torch.no_grad()
    def kv(self, inputs: TranslateInputs, emb: torch.Tensor, out_dtype: torch.dtype = torch.float32,
           residual: torch.Tensor | None = None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Keys and values `[L, H, T_b, D]` (position-free, `out_dtype`) of each block of
        `inputs`, and the groups' states `[G, B, T, d]` (`MoTOutput.hidden`, which expert-fed
        replay heads read); `emb` `[B, T, E]` float32 target embeddings of its ids; `residual`
        the target's residual stream for `native_below` translators (`MoTTranslator.forward`)."""
        mot, cfg, ts = self.mot, self.mot.cfg, self.ts
        src = inputs.src.to(self.dtype)  # once: the groups' projections and the design read it
        h, _, _ = mot.mixture(src, emb, inputs.mask, in_proj=self.in_proj, residual=residual)
        g, b, t = h.shape[:3]
        # the mixture ran on the padded batch (its sequence mixing needs it); everything after
        # is per token, so it runs on the real tokens only, block after block
        rows = inputs.mask.reshape(-1).nonzero().squeeze(1)  # [N]
        head_states = torch.stack([mot.head_norm[i](h[i]) for i in range(g)]).view(g, b * t, -1).index_select(1, rows)
        heads, d, kv = cfg.tgt_kv_heads, cfg.tgt_head_dim, cfg.tgt_kv_dim
        # bias + the embedding's share, computed once per distinct token, enter the product as
        # its addend: the sum is rounded once, like the product alone
        tokens, where = torch.unique(inputs.ids.reshape(-1).index_select(0, rows), return_inverse=True)
        table = self.bias[:, None, :].expand(-1, tokens.numel(), -1)  # [Lt, U, 2kv]
        if self.emb_weight is not None:
            e = unit_rms(ts.embed(tokens).float()).to(self.dtype)
            table = table + (e @ self.emb_weight).view(tokens.numel(), -1, 2 * kv).transpose(0, 1)
        addend = table.to(self.dtype).contiguous().index_select(1, where)  # [Lt, N, 2kv]
        design = self.design(src.view(b * t, -1).index_select(0, rows), head_states)
        y = torch.baddbmm(addend, design, self.weight)  # [Lt, N, 2kv]
        scales = mot.key_scales()
        for j, layer in enumerate(cfg.translated):  # the k-norm and key scales per layer, every token at once
            keys_j = y[j, :, :kv].view(-1, heads, d)
            if cfg.tgt_k_norm:
                norm = ts.layers[layer].self_attn.k_norm
                keys_j.copy_(norm(keys_j))
            if scales is not None:
                keys_j *= scales[layer].to(keys_j.dtype)
        k0, v0 = ts.exact_kv(emb.to(next(ts.model.parameters()).dtype), 0)  # [B, H, T, D]
        n_all = rows.numel()
        k_tr = y[:, :, :kv].view(-1, n_all, heads, d).transpose(1, 2)  # [Lt, H, N, D]
        v_tr = y[:, :, kv:].view(-1, n_all, heads, d).transpose(1, 2)
        # exact layers can only be layer 0 (`TargetSide.exact_kv`): the translated ones are one
        # range, copied (and cast) in one pass per block and side: a few kernels per block, and
        # a working set of one block (a copy of all blocks at once was slower on the CPU)
        first = cfg.translated[0]
        assert cfg.translated == list(range(first, cfg.tgt_layers)), cfg.translated
        result, at = [], 0
        for i, n in enumerate(inputs.lengths):
            keys = torch.empty(cfg.tgt_layers, heads, n, d, dtype=out_dtype, device=y.device)
            values = torch.empty_like(keys)
            for layer in cfg.exact_layers:
                keys[layer], values[layer] = k0[i, :, :n], v0[i, :, :n]
            keys[first:].copy_(k_tr[:, :, at : at + n])
            values[first:].copy_(v_tr[:, :, at : at + n])
            result.append((keys, values))
            at += n
        return result, h
