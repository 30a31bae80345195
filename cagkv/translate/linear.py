"""Closed-form baseline: one ridge regression per target layer (the `linear` rows of reports).

Inputs per target token are the same as the MoT's, without sequence mixing or experts:
the normalised aligned source K/V of the layer's mapped source layers, the RMS-normalised
target token embedding and a bias. Output: the normalised target K|V of that layer, so
`decode`, the exact layer 0 and the target's k-norm are shared with the MoT.

Example:
    >>> lin = fit_ridge(trainer, lam=10.0)   # trainer: a train.Trainer with stats fitted
    >>> trainer.mot = lin; trainer.evaluate()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cagkv.translate.features import unit_rms
from cagkv.translate.mot import MoTConfig, MoTOutput, MoTTranslator

if TYPE_CHECKING:
    from cagkv.translate.train import Trainer

__all__ = ["LinearTranslator", "fit_ridge"]


class LinearTranslator(MoTTranslator):
    """A MoT-compatible module whose forward is one linear map per translated layer."""

    def __init__(self, cfg: MoTConfig) -> None:
        super().__init__(cfg)
        self.layer_cols: list[torch.Tensor] = []
        pos = {s: i for i, s in enumerate(cfg.used_src)}
        feat = 2 * cfg.src_kv_dim
        for l in cfg.translated:
            self.layer_cols.append(torch.cat([torch.arange(pos[s] * feat, (pos[s] + 1) * feat) for s in cfg.layer_map[l]]))
        self.ridge_w: list[torch.Tensor] = []
        self.grams: list[torch.Tensor] = []  # X^T X per layer (bias column last), for reduced rank

    def design(self, src: torch.Tensor, emb: torch.Tensor, i: int) -> torch.Tensor:
        """Design matrix `[B, T, F_i + E + 1]` of translated layer index i."""
        x = (src - self.src_mean) / self.src_std
        e = unit_rms(emb)
        ones = torch.ones(*src.shape[:-1], 1)
        return torch.cat([x.index_select(-1, self.layer_cols[i]), e, ones], -1)

    def forward(self, src: torch.Tensor, emb: torch.Tensor, mask: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> MoTOutput:
        if residual is not None:
            raise ValueError("the linear map reads no residual stream (native_below is a mixture option)")
        ys = [self.design(src, emb, i) @ w for i, w in enumerate(self.ridge_w)]  # each [B, T, 2kv]
        y = torch.stack(ys, 1)  # [B, Lt, T, 2kv]
        zero = y.new_zeros(())
        return MoTOutput(y=y, aux_loss=zero, expert_load=y.new_zeros(1, 1))


@torch.no_grad()
def fit_ridge(trainer: Trainer, lam: float = 10.0, n: int | None = None, batch: int = 8) -> LinearTranslator:
    """Solve each layer's ridge regression on the trainer's training pairs (stats reused)."""
    mot = trainer.mot
    lin = LinearTranslator(mot.cfg)
    for name in ("src_mean", "src_std", "tgt_mean", "tgt_std"):
        getattr(lin, name).copy_(getattr(mot, name))
    cfg = mot.cfg
    n = min(n or len(trainer.pairs), len(trainer.pairs))
    xtx: list[torch.Tensor | None] = [None] * len(cfg.translated)
    xty: list[torch.Tensor | None] = [None] * len(cfg.translated)
    for start in range(0, n, batch):
        bt = trainer.batch([trainer.pairs[i] for i in range(start, min(n, start + batch))])
        emb = trainer.ts.embed(bt["ids"]).float()
        m = bt["mask"]
        y_all = mot.normalise_target(bt["tk"][:, cfg.translated], bt["tv"][:, cfg.translated])  # [B, Lt, T, 2kv]
        for i in range(len(cfg.translated)):
            x = lin.design(bt["src"], emb, i)[m].double()  # [N, F]
            y = y_all[:, i][m].double()  # [N, 2kv]
            xtx[i] = x.T @ x if xtx[i] is None else xtx[i] + x.T @ x
            xty[i] = x.T @ y if xty[i] is None else xty[i] + x.T @ y
    for a, b in zip(xtx, xty):
        assert a is not None and b is not None
        reg = lam * torch.eye(a.shape[0], dtype=a.dtype)
        reg[-1, -1] = 0.0  # no penalty on the bias
        lin.ridge_w.append(torch.linalg.solve(a + reg, b).float())
        lin.grams.append(a)
    return lin
