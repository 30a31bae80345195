"""The Mixture-of-Translators network: aligned source KV + target embeddings -> target KV.

Per target token (on the target's token grid, see `cagkv.align`):

    src   [B, T, n_used * 2 * src_kv]  aligned source K (position-free) and V of the used
                                       source layers, raw; normalised here with stored stats
    emb   [B, T, tgt_embed]            the target's own token embedding (no prefill needed)

Per layer group g (consecutive target layers sharing one block):

    h_g = in_proj_g(src[:, :, cols_g]) + emb_proj(emb)         [B, T, d]
    h_g += causal depthwise conv ; h_g += causal self-attention (sequence mixing)
    h_g += sum_{top-k e} gate_e * expert_{g,e}(h_g)            (router, top-k, balance loss)
    (repeated `blocks` times: each further round of mixing + experts starts as the identity)
    y_l = head_l(norm(h_g)) for target layers l in g           [B, T, 2 * kv_heads * head_dim]
    y_l += stream_l(src, emb, h_g)   for l in `layer_streams`  (a layer's own path, see LayerStream)

`y` is in normalised units (per layer/channel target stats); `decode` turns it into keys
and values. Keys of targets with a k-norm are produced *before* the norm, and the target's
own k-norm module is applied by the caller (`features.TargetSide.k_post`), so translated
keys lie on the target's key manifold. Layers in `exact_layers` (layer 0) are not
translated: the caller computes them exactly from the target's embeddings.

All (token, group, slot) expert assignments go through one `dispatch_experts` call; with
one expert per group there is nothing to route, and the groups' experts run as one batched
product.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cagkv.config import strict_from_dict
from cagkv.translate.dispatch import dispatch_experts, load_balance_loss
from cagkv.translate.features import unit_rms
from cagkv.translate.layermap import layer_groups, used_source_layers

__all__ = ["MoTConfig", "MoTTranslator", "MoTOutput", "BoundaryHead", "reduced_rank", "with_expert_fed_heads", "grown_state", "LayerStream"]

MIXING = ("none", "conv", "attn", "conv+attn")


@dataclass
class MoTConfig:
    """Shape and hyper-parameters of a translator (embedded in every artifact card)."""

    src_layers: int
    src_kv_dim: int  # source kv_heads * head_dim
    tgt_layers: int
    tgt_kv_heads: int
    tgt_head_dim: int
    tgt_embed_dim: int
    layer_map: list[list[int]]  # per target layer, source layers by relative depth
    exact_layers: list[int] = field(default_factory=lambda: [0])
    tgt_k_norm: bool = False  # keys produced pre-norm; the target's k-norm is applied outside
    group_size: int = 3
    d_model: int = 192
    d_expert: int = 384
    experts: int = 4
    top_k: int = 2
    conv_kernel: int = 4
    attn_heads: int = 4
    mixing: str = "conv+attn"
    boundary_layer: int | None = None  # unused (superseded by `boundaries`); kept so older cards load
    tgt_hidden: int = 0
    boundaries: list[int] = field(default_factory=list)  # replay heads: residual stream entering layer b
    boundary_rank: int = 128
    boundary_from_expert: bool = False  # replay heads also read the expert's hidden state of their layer's group
    blocks: int = 1  # rounds of (sequence mixing + expert mixture) per group
    dispatch: str = "auto"
    skip_rank: int = 0  # >0: a low-rank linear path per layer (initialised from ridge), MoT adds to it
    layer_streams: list[int] = field(default_factory=list)  # target layers with a path of their own (LayerStream)
    stream_d: int = 256
    key_scale: bool = False  # a learned scale per translated layer on its keys, after the k-norm (a temperature)
    native_below: int = 0  # >0: the target computes its layers below this one over the chunk itself; the
    # mixture also reads its residual stream entering this layer, and those layers' K/V are the target's (E66)

    def __post_init__(self) -> None:
        if self.mixing not in MIXING:
            raise ValueError(f"mixing must be one of {MIXING}, got {self.mixing!r}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..experts={self.experts}, got {self.top_k}")
        if len(self.layer_map) != self.tgt_layers:
            raise ValueError(f"layer_map has {len(self.layer_map)} rows, expected {self.tgt_layers}")
        if self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")
        bad = [b for b in self.boundaries if not 1 <= b < self.tgt_layers]
        if bad:
            raise ValueError(f"boundaries must lie in 1..{self.tgt_layers - 1}, got {bad}")
        if self.boundaries and self.tgt_hidden < 1:
            raise ValueError("boundaries need tgt_hidden (the target's hidden size)")
        if not 0 <= self.native_below < self.tgt_layers:
            raise ValueError(f"native_below must lie in 0..{self.tgt_layers - 1}, got {self.native_below}")
        if self.native_below and self.tgt_hidden < 1:
            raise ValueError("native_below needs tgt_hidden (the target's hidden size)")
        bad = [l for l in self.layer_streams if l not in self.translated]
        if bad:
            raise ValueError(f"layer_streams must be translated target layers, got {bad}")

    # derived ---------------------------------------------------------------------
    @property
    def tgt_kv_dim(self) -> int:
        return self.tgt_kv_heads * self.tgt_head_dim

    @property
    def translated(self) -> list[int]:
        return [l for l in range(self.tgt_layers) if l not in self.exact_layers]

    @property
    def groups(self) -> list[list[int]]:
        return layer_groups(self.translated, self.group_size)

    @property
    def used_src(self) -> list[int]:
        return used_source_layers(self.layer_map, self.translated)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoTConfig:
        return strict_from_dict(cls, data, "translator config keys")


@dataclass
class MoTOutput:
    y: torch.Tensor  # [B, Lt, T, 2 * kv] normalised K|V of the translated layers
    aux_loss: torch.Tensor  # load-balancing loss (scalar)
    expert_load: torch.Tensor  # [G, E] share of assignments per expert
    hidden: torch.Tensor | None = None  # [G, B, T, d] per-group state after the experts (what the heads read)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def reduced_rank(
    w: torch.Tensor, gram: torch.Tensor | None, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[float, float]]:
    """A ridge map `w [F+1, O]` (bias row last) as `x @ a @ b + bias` of rank <= `rank`.

    With `gram` (the design's X^T X, bias last) this is reduced-rank regression: project
    the output on the top eigenvectors of the fitted values' second moment W^T X^T X W,
    the best rank-r map in the data's metric; otherwise a truncated SVD of W. Returns
    a `[F, k]`, b `[k, O]`, bias `[O]` (float32) and (energy kept, total energy).
    """
    w64 = w.double()
    if gram is not None:
        evals, evecs = torch.linalg.eigh(w64.T @ gram.double() @ w64)  # [O, O]
        order = evals.flip(0).clamp(min=0)
        k = min(rank, evals.numel())
        v = evecs.flip(1)[:, :k]  # [O, k] top output directions
        a, b, bias = w64[:-1] @ v, v.T, w64[-1] @ v @ v.T
        energy = (float(order[:k].sum()), float(order.sum()))
    else:
        u, sv, vh = torch.linalg.svd(w64[:-1], full_matrices=False)
        k = min(rank, sv.numel())
        a, b, bias = u[:, :k] * sv[:k], vh[:k], w64[-1]
        energy = (float((sv[:k] ** 2).sum()), float((sv**2).sum()))
    return a.float(), b.float(), bias.float(), energy


def gather_blocks(x: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
    """`x.index_select(-1, cols)` for `cols` made of whole aligned blocks of `width` columns
    (one per source layer's K|V), gathered as blocks: far fewer strided reads."""
    blocks = cols.view(-1, width)[:, 0] // width
    return x.unflatten(-1, (-1, width)).index_select(-2, blocks).flatten(-2)


def boundary_group(cfg: MoTConfig, layer: int) -> int:
    """The layer group whose expert state an expert-fed replay head of `layer` reads: the
    group holding `layer` (its K/V are a function of the residual stream entering it), or
    the last group below it when `layer` is not translated."""
    below = [g for g, layers in enumerate(cfg.groups) if layers[0] <= layer]
    return below[-1] if below else 0


def boundary_source_layers(cfg: MoTConfig, layer: int) -> list[int]:
    """Source layers read by the replay head of `layer`: those mapped to layers layer-1 and layer."""
    used = set(cfg.used_src)
    return sorted({s for l in (layer - 1, layer) for s in cfg.layer_map[l] if s in used})


class BoundaryHead(nn.Module):
    """Low-rank linear map from [normalised source features | RMS-normed target embedding]
    to the target's residual stream entering one layer, in per-channel normalised units.

    With `cfg.boundary_from_expert` it adds a linear read-out of the expert's (sequence-mixed)
    hidden state of the layer's group, initialised at zero so the head starts as the plain one."""

    def __init__(self, cfg: MoTConfig, layer: int) -> None:
        super().__init__()
        pos = {s: i for i, s in enumerate(cfg.used_src)}
        feat = 2 * cfg.src_kv_dim
        cols = torch.cat([torch.arange(pos[s] * feat, (pos[s] + 1) * feat) for s in boundary_source_layers(cfg, layer)])
        self.register_buffer("cols", cols, persistent=False)
        self.width = feat
        f_in = cols.numel() + cfg.tgt_embed_dim
        self.a = nn.Parameter(torch.zeros(f_in, cfg.boundary_rank))
        self.b = nn.Parameter(torch.zeros(cfg.boundary_rank, cfg.tgt_hidden))
        self.bias = nn.Parameter(torch.zeros(cfg.tgt_hidden))
        self.register_buffer("mean", torch.zeros(cfg.tgt_hidden))
        self.register_buffer("std", torch.ones(cfg.tgt_hidden))
        self.group = None
        if cfg.boundary_from_expert:
            self.group = boundary_group(cfg, layer)
            self.h_norm = RMSNorm(cfg.d_model)
            self.h_proj = nn.Parameter(torch.zeros(cfg.d_model, cfg.tgt_hidden))

    def design(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """`[B, T, F_b + E]` inputs from normalised source features `x` and raw embeddings."""
        return torch.cat([gather_blocks(x, self.cols, self.width), unit_rms(emb)], -1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden`: `MoTOutput.hidden` `[G, B, T, d]` of the same tokens (needed when expert-fed)."""
        y = self.design(x, emb) @ self.a @ self.b + self.bias  # normalised units
        if self.group is not None:
            if hidden is None:
                raise ValueError("this replay head reads the expert's hidden state: pass MoTOutput.hidden")
            y = y + self.h_norm(hidden[self.group]) @ self.h_proj
        return y * self.std + self.mean


class MixBlock(nn.Module):
    """Sequence mixing over a chunk's tokens: causal depthwise conv + causal self-attention."""

    def __init__(self, d: int, kernel: int, heads: int, mode: str) -> None:
        super().__init__()
        self.mode, self.heads, self.kernel = mode, heads, kernel
        if "conv" in mode:
            self.conv_norm = RMSNorm(d)
            self.conv = nn.Conv1d(d, d, kernel, groups=d)
        if "attn" in mode:
            self.attn_norm = RMSNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            nn.init.zeros_(self.proj.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        if "conv" in self.mode:
            x = self.conv_norm(h).transpose(1, 2)  # [B, d, T]
            x = F.pad(x, (self.kernel - 1, 0))  # causal: token t sees t-k+1..t
            h = h + self.conv(x).transpose(1, 2)
        if "attn" in self.mode and t > 0:
            q, k, v = self.qkv(self.attn_norm(h)).chunk(3, dim=-1)
            hd = d // self.heads
            q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))  # [B, nh, T, hd]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))  # [B, T, d]
        return h


class LayerStream(nn.Module):
    """A path of one target layer's own, for layers whose K/V need more than the state they
    share with their group (Gemma-3's full-attention layers, E29b/E31): its mapped source
    layers' features + the target embedding + the group's state -> sequence mixing -> an MLP
    -> K|V, added to the layer's head output. The output projection starts at zero, so a
    translator given streams (`--init`) computes what it did before."""

    def __init__(self, cfg: MoTConfig, n_features: int) -> None:
        super().__init__()
        d = cfg.stream_d
        self.in_proj = nn.Linear(n_features, d)
        self.emb_proj = nn.Linear(cfg.tgt_embed_dim, d, bias=False)
        self.group_proj = nn.Linear(cfg.d_model, d, bias=False)
        self.mix = MixBlock(d, cfg.conv_kernel, cfg.attn_heads, cfg.mixing)
        self.mlp_norm = RMSNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.out_norm = RMSNorm(d)
        self.out = nn.Linear(d, 2 * cfg.tgt_kv_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, group_state: torch.Tensor) -> torch.Tensor:
        """x `[B, T, n_features]` normalised source features, emb `[B, T, E]` normalised
        embedding, group_state `[B, T, d_model]` normalised -> `[B, T, 2kv]`."""
        h = self.mix(self.in_proj(x) + self.emb_proj(emb) + self.group_proj(group_state))
        h = h + self.down(F.gelu(self.up(self.mlp_norm(h))))
        return self.out(self.out_norm(h))


class MixtureRound(nn.Module):
    """A further round of sequence mixing + expert mixture over every group's state, added
    by `MoTConfig.blocks` > 1. Its residual branches start at zero (conv, attention output,
    the experts' second layer), so a translator grown by a round computes what it did before."""

    def __init__(self, cfg: MoTConfig) -> None:
        super().__init__()
        d, n_groups, n_exp, h = cfg.d_model, len(cfg.groups), cfg.experts, cfg.d_expert
        self.mix = nn.ModuleList(MixBlock(d, cfg.conv_kernel, cfg.attn_heads, cfg.mixing) for _ in range(n_groups))
        for m in self.mix:
            if hasattr(m, "conv"):
                nn.init.zeros_(m.conv.weight)
                nn.init.zeros_(m.conv.bias)
        self.router_norm = nn.ModuleList(RMSNorm(d) for _ in range(n_groups))
        self.router = nn.ModuleList(nn.Linear(d, n_exp) for _ in range(n_groups))
        self.W1 = nn.Parameter(torch.randn(n_groups * n_exp, d, h) / math.sqrt(d))
        self.b1 = nn.Parameter(torch.zeros(n_groups * n_exp, h))
        self.W2 = nn.Parameter(torch.zeros(n_groups * n_exp, h, d))
        self.b2 = nn.Parameter(torch.zeros(n_groups * n_exp, d))


class MoTTranslator(nn.Module):
    """Per layer-group mixture of small MLP experts with a top-k router. See module doc.

    Example:
        >>> mot = MoTTranslator(cfg)
        >>> out = mot(src, emb)          # src [B, T, F], emb [B, T, E]
        >>> out.y.shape                  # [B, len(cfg.translated), T, 2 * kv]
    """

    def __init__(self, cfg: MoTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, kv2 = cfg.d_model, 2 * cfg.tgt_kv_dim
        n_used = len(cfg.used_src)
        pos = {s: i for i, s in enumerate(cfg.used_src)}
        feat = 2 * cfg.src_kv_dim
        # normalisation statistics (filled by training, stored with the weights)
        self.register_buffer("src_mean", torch.zeros(n_used * feat))
        self.register_buffer("src_std", torch.ones(n_used * feat))
        self.register_buffer("tgt_mean", torch.zeros(cfg.tgt_layers, kv2))
        self.register_buffer("tgt_std", torch.ones(cfg.tgt_layers, kv2))
        self.emb_norm = RMSNorm(cfg.tgt_embed_dim)
        self.emb_proj = nn.Linear(cfg.tgt_embed_dim, d)
        self.in_proj = nn.ModuleList()
        self.mix = nn.ModuleList()
        self.router_norm = nn.ModuleList()
        self.router = nn.ModuleList()
        self.head_norm = nn.ModuleList()
        self._cols: list[torch.Tensor] = []
        for g, layers in enumerate(cfg.groups):
            src_layers = used_source_layers(cfg.layer_map, layers)
            cols = torch.cat([torch.arange(pos[s] * feat, (pos[s] + 1) * feat) for s in src_layers])
            self.register_buffer(f"cols_{g}", cols, persistent=False)
            self.in_proj.append(nn.Linear(cols.numel(), d))
            self.mix.append(MixBlock(d, cfg.conv_kernel, cfg.attn_heads, cfg.mixing))
            self.router_norm.append(RMSNorm(d))
            self.router.append(nn.Linear(d, cfg.experts))
            self.head_norm.append(RMSNorm(d))
        n_groups, n_exp, h = len(cfg.groups), cfg.experts, cfg.d_expert
        # experts of all groups stacked: global expert id = g * E + e
        self.W1 = nn.Parameter(torch.randn(n_groups * n_exp, d, h) / math.sqrt(d))
        self.b1 = nn.Parameter(torch.zeros(n_groups * n_exp, h))
        self.W2 = nn.Parameter(torch.randn(n_groups * n_exp, h, d) * (0.5 / math.sqrt(h)))
        self.b2 = nn.Parameter(torch.zeros(n_groups * n_exp, d))
        self.rounds = nn.ModuleList(MixtureRound(cfg) for _ in range(cfg.blocks - 1))
        n_tr = len(cfg.translated)
        self.head_w = nn.Parameter(torch.randn(n_tr, d, kv2) / math.sqrt(d))
        self.head_b = nn.Parameter(torch.zeros(n_tr, kv2))
        self.boundary = nn.ModuleDict({str(b): BoundaryHead(cfg, b) for b in cfg.boundaries})
        self.streams = nn.ModuleDict()
        for l in cfg.layer_streams:
            cols = torch.cat([torch.arange(pos[s] * feat, (pos[s] + 1) * feat) for s in cfg.layer_map[l]])
            self.register_buffer(f"stream_cols_{l}", cols, persistent=False)
            self.streams[str(l)] = LayerStream(cfg, cols.numel())
        if cfg.skip_rank > 0:
            # per translated layer: [its mapped source layers' features | normalised embedding] -> K|V
            skip_cols = torch.stack([
                torch.cat([torch.arange(pos[s] * feat, (pos[s] + 1) * feat) for s in cfg.layer_map[l]])
                for l in cfg.translated
            ])  # [Lt, n_map * feat]; every row has the same width (nearest is fixed)
            self.register_buffer("skip_cols", skip_cols, persistent=False)
            f_in = skip_cols.shape[1] + cfg.tgt_embed_dim
            self.skip_a = nn.Parameter(torch.zeros(n_tr, f_in, cfg.skip_rank))
            self.skip_b = nn.Parameter(torch.zeros(n_tr, cfg.skip_rank, kv2))
            self.skip_bias = nn.Parameter(torch.zeros(n_tr, kv2))
        if cfg.native_below:
            # per group: the target's own residual stream entering layer `native_below` (unit RMS)
            # into the group's state; zero at the start, so a translator given it (`--init`)
            # computes what it did before
            self.res_proj = nn.Parameter(torch.zeros(len(cfg.groups), cfg.tgt_hidden, d))
        if cfg.key_scale:
            # log of each target layer's key scale; a k-norm fixes a key's length, so without it the
            # translator cannot sharpen or soften the attention its keys draw (see `key_scales`)
            self.key_log_scale = nn.Parameter(torch.zeros(cfg.tgt_layers))

    # ------------------------------------------------------------------ forward
    def forward(self, src: torch.Tensor, emb: torch.Tensor, mask: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> MoTOutput:
        """src `[B, T, n_used*2*src_kv]` raw aligned source KV, emb `[B, T, E]`; mask `[B, T]` real
        tokens; residual `[B, T, hidden]` the target's residual stream entering layer
        `cfg.native_below` (needed when that is set)."""
        cfg = self.cfg
        x = self.normalise_source(src)
        h, aux, load = self.mixture(x, emb, mask, residual=residual)
        ys = []
        for g, layers in enumerate(cfg.groups):
            hn = self.head_norm[g](h[g])  # [B, T, d]
            idx = [cfg.translated.index(l) for l in layers]
            w, bias = self.head_w[idx], self.head_b[idx]  # [n, d, 2kv], [n, 2kv]
            ys.append(torch.einsum("btd,ndo->bnto", hn, w) + bias[None, :, None, :])
        y = torch.cat(ys, dim=1)  # [B, Lt, T, 2kv]
        if cfg.layer_streams:
            y = y + self._streams(x, emb, h, y)
        if cfg.skip_rank > 0:
            y = y + self.skip(x, emb)
        return MoTOutput(y=y, aux_loss=aux, expert_load=load.detach(), hidden=h)

    def mixture(self, x: torch.Tensor, emb: torch.Tensor, mask: torch.Tensor | None = None,
                in_proj: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every group's state after sequence mixing and experts, `[G, B, T, d]`, with the
        balance loss and the expert load. `x` is the normalised source features, or, with
        `in_proj` (per group a weight and bias that take the normalisation in, see
        `cagkv.translate.folded`), the raw ones, in the dtype of those weights. `residual`:
        see `forward`."""
        cfg = self.cfg
        b, t, _ = x.shape
        e = self.emb_proj(self.emb_norm(emb))  # [B, T, d]
        r = None
        if cfg.native_below:
            if residual is None:
                raise ValueError(f"this translator reads the target's residual stream entering layer "
                                 f"{cfg.native_below}: pass `residual`")
            r = unit_rms(residual.to(e.dtype))
        hs = []
        for g in range(len(cfg.groups)):
            feats = gather_blocks(x, getattr(self, f"cols_{g}"), 2 * cfg.src_kv_dim)
            proj = self.in_proj[g](feats) if in_proj is None else F.linear(feats, *in_proj[g])
            inp = proj.to(e.dtype) + e
            hs.append(self.mix[g](inp if r is None else inp + r @ self.res_proj[g]))
        h = torch.stack(hs)  # [G, B, T, d]
        keep = torch.ones(b, t, dtype=torch.bool, device=h.device) if mask is None else mask.bool()
        h, aux, load = self._experts(h, keep, self.router_norm, self.router, (self.W1, self.b1, self.W2, self.b2))
        for rnd in self.rounds:
            h = torch.stack([rnd.mix[g](h[g]) for g in range(h.shape[0])])
            h, aux_r, load_r = self._experts(h, keep, rnd.router_norm, rnd.router, (rnd.W1, rnd.b1, rnd.W2, rnd.b2))
            aux, load = aux + aux_r, load + load_r
        return h, aux / cfg.blocks, load / cfg.blocks

    def _streams(self, x: torch.Tensor, emb: torch.Tensor, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The layer streams' outputs, zero on the other layers, `[B, Lt, T, 2kv]` like `y`."""
        cfg, extra = self.cfg, torch.zeros_like(y)
        e = self.emb_norm(emb)
        for l in cfg.layer_streams:
            g = next(i for i, layers in enumerate(cfg.groups) if l in layers)
            feats = gather_blocks(x, getattr(self, f"stream_cols_{l}"), 2 * cfg.src_kv_dim)
            extra[:, cfg.translated.index(l)] = self.streams[str(l)](feats, e, self.head_norm[g](h[g]))
        return extra

    def _experts(self, h: torch.Tensor, keep: torch.Tensor, router_norm: nn.ModuleList, router: nn.ModuleList,
                 weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One round of the per-group expert mixture on `h [G, B, T, d]`: every (token, group,
        slot) assignment in one dispatch. Returns (h + mixture, balance loss, load `[G, E]`)."""
        cfg = self.cfg
        n_groups, n_exp, k = h.shape[0], cfg.experts, cfg.top_k
        if n_exp == 1:  # one expert per group: no routing (its gate is 1), one batched product
            w1, b1, w2, b2 = weights
            x = h.reshape(n_groups, -1, h.shape[-1])  # [G, B*T, d]
            mixed = torch.baddbmm(b2[:, None, :], F.silu(torch.baddbmm(b1[:, None, :], x, w1)), w2)
            return h + mixed.view_as(h), h.new_ones(()), h.new_ones(n_groups, 1)  # balance loss 1: balanced
        logits = torch.stack([router[g](router_norm[g](h[g])) for g in range(n_groups)])  # [G, B, T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, top_i = probs.topk(k, dim=-1)  # [G, B, T, k]
        gate = (top_p / top_p.sum(-1, keepdim=True)).to(h.dtype)
        offset = (torch.arange(n_groups, device=h.device) * n_exp).view(n_groups, 1, 1, 1)
        mixed = dispatch_experts(
            h.reshape(-1, h.shape[-1]),  # [G*B*T, d]
            (top_i + offset).reshape(-1, k),
            gate.reshape(-1, k),
            *weights,
            impl=cfg.dispatch,
        )
        aux = h.new_zeros(())
        load = h.new_zeros(n_groups, n_exp)
        for g in range(n_groups):
            p_g, i_g = probs[g][keep], top_i[g][keep]  # [N, E], [N, k]
            aux = aux + load_balance_loss(p_g, i_g, n_exp) / n_groups
            if i_g.numel():
                load[g] = torch.bincount(i_g.reshape(-1), minlength=n_exp).float() / i_g.numel()
        return h + mixed.reshape(h.shape), aux, load

    def skip_inputs(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear path's inputs: each translated layer's normalised source features
        `[B, T, Lt, n_map*feat]` and the normalised embedding `[B, T, E]` every layer shares."""
        b, t, _ = x.shape
        sources = gather_blocks(x, self.skip_cols.reshape(-1), 2 * self.cfg.src_kv_dim).reshape(b, t, self.skip_cols.shape[0], -1)
        return sources, unit_rms(emb)

    def skip_design(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Inputs of the linear path as one design: `[B, T, Lt, F]` (source features | embedding)."""
        sources, e = self.skip_inputs(x, emb)
        return torch.cat([sources, e[:, :, None, :].expand(*sources.shape[:3], e.shape[-1])], -1)

    def skip(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The low-rank linear path `[B, Lt, T, 2kv]`."""
        folded = getattr(self, "_skip_w", None)
        if folded is not None and not self.training:  # one product: cheaper at high rank
            # the design's embedding columns are the same for every layer: one GEMM for all
            # layers' share of them instead of a [B, T, Lt, F] copy of the design
            source_w, embedding_w = folded
            sources, e = self.skip_inputs(x, emb)
            sources, e = sources.to(source_w.dtype), e.to(source_w.dtype)
            b, t, n_tr, _ = sources.shape
            y = torch.einsum("btlf,lfo->blto", sources, source_w).to(x.dtype)
            y += (e.reshape(b * t, -1) @ embedding_w).view(b, t, n_tr, -1).transpose(1, 2)
            return y + self.skip_bias[None, :, None, :]
        z = torch.einsum("btlf,lfr->btlr", self.skip_design(x, emb), self.skip_a)
        y = torch.einsum("btlr,lro->blto", z, self.skip_b)
        return y + self.skip_bias[None, :, None, :]

    @torch.no_grad()
    def fold_skip(self, dtype: torch.dtype | None = None) -> bool:
        """For inference: keep `skip_a @ skip_b` as one matrix per layer when that costs
        fewer multiply-adds per token than the two factors (rank above F*O/(F+O)), in
        `dtype` (default: the weights'; the path then multiplies in it and returns the
        weights' dtype). Cleared by `train()`. Returns whether it folded."""
        if self.cfg.skip_rank <= 0:
            return False
        f, r, o = self.skip_a.shape[1], self.skip_a.shape[2], self.skip_b.shape[2]
        if f * o >= r * (f + o):
            self._skip_w = None
            return False
        w = torch.bmm(self.skip_a, self.skip_b)  # [Lt, F, 2kv]: the source columns, then the embedding's
        n_emb = self.cfg.tgt_embed_dim
        source_w = w[:, : f - n_emb].contiguous()
        embedding_w = w[:, f - n_emb :].transpose(0, 1).reshape(n_emb, -1).contiguous()  # [E, Lt * 2kv]
        if dtype is not None:
            source_w, embedding_w = source_w.to(dtype), embedding_w.to(dtype)
        self._skip_w = (source_w, embedding_w)
        return True

    def train(self, mode: bool = True) -> MoTTranslator:
        if mode:
            self._skip_w = None  # weights may change: drop the folded copy
        return super().train(mode)

    @torch.no_grad()
    def init_skip_from_ridge(self, ridge_w: list[torch.Tensor], grams: list[torch.Tensor] | None = None) -> float:
        """Start the linear path as a rank-r version of each layer's ridge map `[F+1, 2kv]`
        (bias last) and zero the MoT heads, so the translator starts as (reduced-rank) ridge.

        With `grams` (each layer's design Gram matrix X^T X, bias column last) the rank-r
        map is reduced-rank regression: W V V^T with V the top eigenvectors of the fitted
        values' second moment W^T X^T X W, the best rank-r map in the data's metric.
        Without, a plain truncated SVD of W. Returns the share of the fitted values'
        (or of W's) energy kept.
        """
        r = self.cfg.skip_rank
        kept, total = 0.0, 0.0
        for i, w in enumerate(ridge_w):
            a, b, bias, (k_i, t_i) = reduced_rank(w, None if grams is None else grams[i], r)
            k = a.shape[1]
            kept += k_i
            total += t_i
            self.skip_a[i].zero_()
            self.skip_b[i].zero_()
            self.skip_a[i, :, :k].copy_(a.float())
            self.skip_b[i, :k].copy_(b.float())
            self.skip_bias[i].copy_(bias.float())
        self.head_w.zero_()
        self.head_b.zero_()
        return kept / max(total, 1e-12)

    def boundary_hidden(self, src: torch.Tensor, emb: torch.Tensor, layer: int,
                        hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The target's residual stream entering `layer` `[B, T, hidden]`, predicted from the
        raw aligned source features and the target's embeddings (the replay head); `hidden`
        (`MoTOutput.hidden` of the same tokens) feeds expert-fed heads."""
        if str(layer) not in self.boundary:
            have = sorted(self.cfg.boundaries)
            raise KeyError(f"no boundary head for layer {layer} (heads: {have})")
        return self.boundary[str(layer)](self.normalise_source(src), emb, hidden)

    # ------------------------------------------------------------------ units
    def normalise_source(self, src: torch.Tensor) -> torch.Tensor:
        """Raw aligned source features -> the normalised input of the mixture, the linear
        path (`skip`) and the replay heads."""
        return (src - self.src_mean) / self.src_std

    def decode(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised `y [B, Lt, T, 2kv]` -> keys, values `[B, Lt, T, kv]` in target units.

        Keys of k-norm targets are returned in the target's *post-norm* units too; the
        caller divides by the k-norm scale and re-applies the norm (see TargetSide).
        """
        idx = torch.tensor(self.cfg.translated, device=y.device)
        mean, std = self.tgt_mean[idx][None, :, None, :], self.tgt_std[idx][None, :, None, :]
        out = y * std + mean
        kv = self.cfg.tgt_kv_dim
        return out[..., :kv], out[..., kv:]

    def normalise_target(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Native keys/values `[B, Lt, T, kv]` of the translated layers -> normalised `y`."""
        idx = torch.tensor(self.cfg.translated, device=k.device)
        mean, std = self.tgt_mean[idx][None, :, None, :], self.tgt_std[idx][None, :, None, :]
        return (torch.cat([k, v], dim=-1) - mean) / std

    def key_scales(self) -> torch.Tensor | None:
        """`[L]` factors for the translated keys (after the k-norm), or None without `cfg.key_scale`."""
        return self.key_log_scale.exp() if self.cfg.key_scale else None

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def with_expert_fed_heads(mot: MoTTranslator) -> MoTTranslator:
    """A copy of `mot` whose replay heads also read the expert's hidden state
    (`boundary_from_expert`); the new read-outs start at zero, so the copy's outputs equal `mot`'s."""
    if mot.cfg.boundary_from_expert:
        return mot
    new = MoTTranslator(dataclasses.replace(mot.cfg, boundary_from_expert=True))
    missing, unexpected = new.load_state_dict(mot.state_dict(), strict=False)
    fresh = [k for k in missing if not k.endswith((".h_proj", ".h_norm.weight"))]
    if fresh or unexpected:
        raise ValueError(f"state mismatch: missing {fresh}, unexpected {unexpected}")
    return new.train(mot.training)


_HIDDEN_AXIS = {"W1": -1, "b1": -1, "W2": -2}  # the experts' hidden dimension in each tensor
_EXPERT_TENSORS = ("W1", "b1", "W2", "b2")  # first axis: group * experts + expert


@torch.no_grad()
def grown_state(new: MoTTranslator, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `old` (a translator's state dict) that fit `new`: those of the same
    shape as they are, and the experts' first/second layers of a narrower translator copied
    into the first hidden units of `new`'s wider ones, whose further units start with zero
    second-layer rows. So a translator grown in `d_expert` (or by further `blocks`, which
    start as the identity) computes exactly what `old` did. One expert per group grown to
    several (sparse upcycling) is copied into each of them: the gates of the top-k experts
    sum to one, so identical experts compute the old expert whatever the (fresh) router
    picks. Tensors that fit none of these ways are left out (the caller keeps `new`'s own)."""
    own = new.state_dict()
    n_groups, n_exp = len(new.cfg.groups), new.cfg.experts
    out: dict[str, torch.Tensor] = {}
    for name, v in old.items():
        if name not in own:
            continue
        mine = own[name]
        if (name.rsplit(".", 1)[-1] in _EXPERT_TENSORS and n_exp > 1 and v.shape[0] == n_groups
                and mine.shape[0] == n_groups * n_exp):
            v = v.repeat_interleave(n_exp, dim=0)
        if ".router." in f".{name}" and n_exp > 1 and v.shape[0] == 1 and mine.shape[0] == n_exp:
            out[name] = mine  # a one-expert translator never routes: the new router starts fresh
            continue
        if mine.shape == v.shape:
            out[name] = v
            continue
        axis = _HIDDEN_AXIS.get(name.rsplit(".", 1)[-1])
        if axis is None or mine.dim() != v.dim() or mine.shape[axis] < v.shape[axis]:
            continue
        if any(a != b for i, (a, b) in enumerate(zip(mine.shape, v.shape)) if i != mine.dim() + axis):
            continue
        grown = mine.clone()
        if name.endswith("W2"):
            grown.zero_()
        grown.narrow(axis, 0, v.shape[axis]).copy_(v)
        out[name] = grown
    return out
