"""Streaming closed-form fit: per-layer ridge maps and replay heads over a large text corpus.

The ridge solution needs only each design's Gram matrix X^T X and X^T Y, so the fit
streams chunks of real text through both models once and never stores features:

    chunk text -> source prefill (after its prefix, as at ingest) -> aligned source K|V
               -> target prefill (after its prefix) -> its K|V per layer and its residual
                  stream entering each replay boundary
               -> X^T X, X^T Y per translated layer and per boundary (float64)

Designs are the ones the translator evaluates (`MoTTranslator.skip_design` for K|V,
`BoundaryHead.design` for the residual stream) with a bias column last; targets are in
per-channel normalised units (statistics from the first `stats_chunks` chunks). The
accumulators are checkpointed every `save_every` chunks, so an interrupted fit resumes.

`to_translator` turns a fit into a `MoTTranslator` whose linear path (rank `skip_rank`,
reduced-rank regression; full rank = exactly ridge) and replay heads (rank
`boundary_rank`) hold the solutions, with the mixture's heads at zero.

Example:
    >>> fit = RidgeFit.new(cfg)                      # cfg: a MoTConfig with boundaries
    >>> fit.add_texts(source, target, texts)         # resumable with fit.save / RidgeFit.load
    >>> mot = fit.to_translator(lam=30.0)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from cagkv.align import align_tokens, token_offsets
from cagkv.models.cache import extract_kv, full_cache
from cagkv.prompt import PromptFormat
from cagkv.translate.pairs import prefill_kv
from cagkv.translate.features import TargetSide, running_stats, source_features
from cagkv.translate.mot import MoTConfig, MoTTranslator, reduced_rank

if TYPE_CHECKING:
    from cagkv.models import LoadedModel

__all__ = ["RidgeFit", "chunk_arrays"]


@torch.no_grad()
def chunk_arrays(source: LoadedModel, target: LoadedModel, text: str, boundaries: list[int],
                 src_used: list[int], prefixes: tuple[list[int], list[int]] | None = None) -> dict[str, Any]:
    """One chunk's paired arrays on the target's token grid (see module doc). `prefixes`:
    the source's and target's context-prefix ids (computed here when None)."""
    s_prefix, t_prefix = prefixes or context_prefixes(source, target)
    s_ids, s_off = token_offsets(source.tokenizer, text)
    t_ids, t_off = token_offsets(target.tokenizer, text)
    sk, sv = prefill_kv(source, s_prefix, s_ids.tolist())
    t_out = target.model(input_ids=torch.tensor([t_prefix + t_ids.tolist()]), cache=full_cache(), use_cache=True,
                         output_hidden_states=bool(boundaries), logits_to_keep=1)
    P, T = len(t_prefix), t_ids.numel()
    tk, tv = extract_kv(t_out.cache, target.spec, torch.arange(P, P + T))
    src = align_tokens(s_off, t_off) @ source_features(sk, sv, src_used)  # [T, F]
    hidden = {b: t_out.hidden_states[b][0, P:].float() for b in boundaries}  # entering layer b
    return {"ids": t_ids, "src": src.float(), "tk": tk.float(), "tv": tv.float(), "hidden": hidden}


def context_prefixes(source: LoadedModel, target: LoadedModel) -> tuple[list[int], list[int]]:
    """The context-prefix ids of both models (chunks are prefilled after them, as at ingest)."""
    return PromptFormat.for_model(source).context_prefix_ids(), PromptFormat.for_model(target).context_prefix_ids()


@dataclass
class _Normal:
    """Accumulated normal equations of one ridge problem."""

    xtx: torch.Tensor
    xty: torch.Tensor
    rows: int = 0
    yty: float = 0.0  # sum of squared targets (for R^2)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x1 = torch.cat([x, torch.ones(x.shape[0], 1)], 1)  # bias column last
        self.xtx += (x1.T @ x1).double()
        self.xty += (x1.T @ y).double()
        self.rows += x.shape[0]
        self.yty += float((y.double() ** 2).sum())

    def r2(self, lam: float) -> float:
        """In-sample R^2 of the ridge solution, averaged over output channels' total variance."""
        w = self.solve(lam).double()
        fitted = (w * (self.xtx @ w)).sum()  # ||Xw||^2
        cross = (w * self.xty).sum()  # <Xw, Y>
        mean_y = self.xty[-1] / max(self.rows, 1)  # the bias column sums Y
        ss_tot = self.yty - self.rows * float((mean_y**2).sum())
        ss_res = self.yty - 2 * float(cross) + float(fitted)
        return 1.0 - ss_res / max(ss_tot, 1e-12)

    def solve(self, lam: float) -> torch.Tensor:
        reg = lam * torch.eye(self.xtx.shape[0], dtype=torch.float64)
        reg[-1, -1] = 0.0  # the bias is not penalised
        return torch.linalg.solve(self.xtx + reg, self.xty).float()


@dataclass
class RidgeFit:
    """Statistics and normal equations of a streaming fit. See module doc."""

    cfg: MoTConfig
    mot: MoTTranslator  # holds the normalisation statistics and the design functions
    layers: list[_Normal] = field(default_factory=list)
    heads: dict[int, _Normal] = field(default_factory=dict)
    texts_done: int = 0
    tokens: int = 0
    seconds: float = 0.0
    has_stats: bool = False

    @classmethod
    def new(cls, cfg: MoTConfig) -> RidgeFit:
        mot = MoTTranslator(cfg)
        if cfg.skip_rank <= 0:
            raise ValueError("a ridge fit needs a linear path: set skip_rank > 0 in the config")
        return cls(cfg=cfg, mot=mot)

    # ------------------------------------------------------------------ accumulate
    def _fit_stats(self, arrays: list[dict[str, Any]]) -> None:
        mot, cfg = self.mot, self.cfg
        mean, std = running_stats([a["src"] for a in arrays])
        mot.src_mean.copy_(mean)
        mot.src_std.copy_(std)
        for l in range(cfg.tgt_layers):
            m, s = running_stats([torch.cat([a["tk"][l], a["tv"][l]], -1).permute(1, 0, 2).reshape(a["tk"].shape[2], -1)
                                  for a in arrays])
            mot.tgt_mean[l].copy_(m)
            mot.tgt_std[l].copy_(s)
        for b in cfg.boundaries:
            m, s = running_stats([a["hidden"][b] for a in arrays])
            mot.boundary[str(b)].mean.copy_(m)
            mot.boundary[str(b)].std.copy_(s)
        self.has_stats = True

    def _accumulate(self, a: dict[str, Any], ts: TargetSide) -> None:
        mot, cfg = self.mot, self.cfg
        src, emb = a["src"][None], ts.embed(a["ids"][None]).float()  # [1, T, F], [1, T, E]
        x = mot.normalise_source(src)
        design = mot.skip_design(x, emb)[0]  # [T, Lt, F_l]
        tr = cfg.translated
        k = a["tk"][tr].permute(0, 2, 1, 3).reshape(len(tr), a["tk"].shape[2], -1)  # [Lt, T, kv]
        v = a["tv"][tr].permute(0, 2, 1, 3).reshape(len(tr), a["tv"].shape[2], -1)
        y = mot.normalise_target(k[None], v[None])[0]  # [Lt, T, 2kv]
        if not self.layers:
            f, o = design.shape[-1] + 1, y.shape[-1]
            self.layers = [_Normal(torch.zeros(f, f, dtype=torch.float64), torch.zeros(f, o, dtype=torch.float64))
                           for _ in tr]
        for i in range(len(tr)):
            self.layers[i].add(design[:, i], y[i])
        for b in cfg.boundaries:
            head = mot.boundary[str(b)]
            xb = head.design(x, emb)[0]  # [T, F_b]
            yb = (a["hidden"][b] - head.mean) / head.std
            if b not in self.heads:
                f = xb.shape[-1] + 1
                self.heads[b] = _Normal(torch.zeros(f, f, dtype=torch.float64),
                                        torch.zeros(f, yb.shape[-1], dtype=torch.float64))
            self.heads[b].add(xb, yb)

    def add_texts(self, source: LoadedModel, target: LoadedModel, texts: list[str], stats_chunks: int = 48,
                  save_to: str | Path | None = None, save_every: int = 100,
                  progress: Callable[[int, int, int], None] | None = None, max_seconds: float = 0.0) -> None:
        """Stream `texts[self.texts_done:]` into the fit (statistics from the first
        `stats_chunks` texts first). Saves to `save_to` every `save_every` texts and at the end."""
        ts = TargetSide(target.model)
        t0 = time.time()
        seconds0 = self.seconds
        pending: list[dict[str, Any]] = []
        used = self.cfg.used_src
        prefixes = context_prefixes(source, target)
        for i in range(self.texts_done, len(texts)):
            a = chunk_arrays(source, target, texts[i], self.cfg.boundaries, used, prefixes)
            if not self.has_stats:
                pending.append(a)
                if len(pending) < min(stats_chunks, len(texts)):
                    continue
                self._fit_stats(pending)
            for item in pending or [a]:
                self._accumulate(item, ts)
                self.tokens += int(item["ids"].numel())
            pending = []
            self.texts_done = i + 1
            self.seconds = seconds0 + time.time() - t0
            if progress:
                progress(self.texts_done, len(texts), self.tokens)
            if save_to and self.texts_done % save_every == 0:
                self.save(save_to)
            if max_seconds and time.time() - t0 > max_seconds:
                break
        if pending:  # fewer texts than stats_chunks
            self._fit_stats(pending)
            for item in pending:
                self._accumulate(item, ts)
                self.tokens += int(item["ids"].numel())
            self.texts_done = len(texts)
        if save_to:
            self.save(save_to)

    # ------------------------------------------------------------------ solve
    def to_translator(self, lam: float = 30.0, lam_boundary: float | None = None,
                      **overrides: Any) -> MoTTranslator:
        """A translator whose linear path and replay heads hold the ridge solutions.

        `overrides` change config fields that do not shape the fit (e.g. `skip_rank`,
        `boundary_rank`, the mixture's `experts` / `d_model`); the mixture starts at zero.
        """
        if not self.layers:
            raise ValueError("the fit has seen no text")
        fixed = ("src_layers", "src_kv_dim", "tgt_layers", "tgt_kv_heads", "tgt_head_dim", "tgt_embed_dim",
                 "layer_map", "exact_layers", "tgt_k_norm", "boundaries", "tgt_hidden")
        bad = sorted(set(overrides) & set(fixed))
        if bad:
            raise ValueError(f"these fields shape the fit and cannot be changed: {bad}")
        cfg = MoTConfig.from_dict({**self.cfg.to_dict(), **overrides})
        if cfg.skip_rank <= 0:
            raise ValueError("the translator needs a linear path: skip_rank > 0")
        mot = MoTTranslator(cfg)
        stats = {k: v for k, v in self.mot.state_dict().items()
                 if k in ("src_mean", "src_std", "tgt_mean", "tgt_std") or k.endswith((".mean", ".std"))}
        mot.load_state_dict(stats, strict=False)
        ws = [n.solve(lam) for n in self.layers]
        mot.init_skip_from_ridge(ws, [n.xtx for n in self.layers])
        with torch.no_grad():
            for b, normal in self.heads.items():
                a, bb, bias, _ = reduced_rank(normal.solve(lam if lam_boundary is None else lam_boundary), normal.xtx,
                                              cfg.boundary_rank)
                head = mot.boundary[str(b)]
                head.a.zero_()
                head.b.zero_()
                head.a[:, : a.shape[1]].copy_(a)
                head.b[: bb.shape[0]].copy_(bb)
                head.bias.copy_(bias)
        return mot

    def r2(self, lam: float = 30.0) -> dict[str, Any]:
        """In-sample R^2 per translated layer and per boundary (from the normal equations)."""
        return {"layers": [round(n.r2(lam), 4) for n in self.layers],
                "boundaries": {str(b): round(n.r2(lam), 4) for b, n in self.heads.items()}}

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "cfg": self.cfg.to_dict(), "mot": self.mot.state_dict(),
            "layers": [(n.xtx, n.xty, n.rows, n.yty) for n in self.layers],
            "heads": {b: (n.xtx, n.xty, n.rows, n.yty) for b, n in self.heads.items()},
            "texts_done": self.texts_done, "tokens": self.tokens, "seconds": self.seconds, "has_stats": self.has_stats,
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> RidgeFit:
        state = torch.load(path, weights_only=True)
        fit = cls.new(MoTConfig.from_dict(state["cfg"]))
        fit.mot.load_state_dict(state["mot"])
        fit.layers = [_Normal(*n) for n in state["layers"]]
        fit.heads = {int(b): _Normal(*n) for b, n in state["heads"].items()}
        fit.texts_done, fit.tokens, fit.seconds = state["texts_done"], state["tokens"], state["seconds"]
        fit.has_stats = state["has_stats"]
        return fit
