"""Batched expert dispatch: every (token, slot) assignment through one grouped computation.

Experts are small MLPs `silu(x @ W1[e] + b1[e]) @ W2[e] + b2[e]` with stacked weights.
Assignments are sorted by expert (callers flatten (layer-group, expert) into one global
expert id, so a whole translation is one call), computed group by group, weighted by
their gate and scattered back with `index_add_`.

Implementations (`impl`):
    "dense"    reference: every expert on every token, masked by the gates (E/k more work)
    "loop"     one matmul per non-empty expert over its contiguous sorted segment
    "bmm"      segments padded to the largest one, two batched matmuls
    "grouped"  `torch._grouped_mm` over the sorted rows with per-expert offsets
    "auto"     "grouped" where it is available (CUDA, or CPU float32), else "loop"

Example:
    >>> y = dispatch_experts(x, idx, gate, W1, b1, W2, b2)  # x [N, d], idx/gate [N, k] -> [N, o]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["dispatch_experts", "IMPLS", "load_balance_loss"]

IMPLS = ("auto", "dense", "loop", "bmm", "grouped")


def dispatch_experts(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    gate: torch.Tensor,
    W1: torch.Tensor,
    b1: torch.Tensor,
    W2: torch.Tensor,
    b2: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """Mixture output `[N, o]` = sum over slots of gate * expert(x).

    Args:
        x: `[N, d]` token features.
        expert_idx: `[N, k]` int64 expert of each slot, in `[0, E)`.
        gate: `[N, k]` slot weights (same dtype family as x).
        W1: `[E, d, h]`, b1: `[E, h]`, W2: `[E, h, o]`, b2: `[E, o]` stacked expert weights.
        impl: one of `IMPLS`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    n, d = x.shape
    n_exp, _, h = W1.shape
    o = W2.shape[2]
    assert expert_idx.shape == gate.shape and expert_idx.shape[0] == n, (expert_idx.shape, gate.shape, x.shape)
    if impl == "auto":
        impl = _auto_impl(x, d, h, o)
    if impl == "dense":
        return _dense(x, expert_idx, gate, W1, b1, W2, b2)
    k = expert_idx.shape[1]
    flat_e = expert_idx.reshape(-1)  # [N*k]
    order = torch.argsort(flat_e, stable=True)  # assignments sorted by expert
    e_sorted = flat_e[order]
    token = torch.div(order, k, rounding_mode="floor")  # token of each sorted assignment
    counts = torch.bincount(flat_e, minlength=n_exp)  # [E]
    xs = x.index_select(0, token)  # [N*k, d]
    if impl == "loop":
        y = _loop(xs, counts, W1, b1, W2, b2)
    elif impl == "bmm":
        y = _bmm(xs, e_sorted, counts, W1, b1, W2, b2)
    else:
        y = _grouped(xs, e_sorted, counts, W1, b1, W2, b2)
    y = y * gate.reshape(-1)[order].unsqueeze(1).to(y.dtype)  # [N*k, o]
    out = torch.zeros(n, o, dtype=y.dtype, device=y.device)
    return out.index_add(0, token, y)


def load_balance_loss(probs: torch.Tensor, expert_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch-style balance loss `E * sum_e f_e * P_e` (1.0 when perfectly balanced).

    probs: `[N, E]` router softmax; expert_idx: `[N, k]` chosen experts.
    """
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(expert_idx.reshape(-1), minlength=n_experts).to(probs.dtype)
    frac = counts / counts.sum()  # f_e: share of assignments
    return n_experts * (frac * probs.mean(dim=0)).sum()


# ------------------------------------------------------------------ implementations
def _auto_impl(x: torch.Tensor, d: int, h: int, o: int) -> str:
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    if x.is_cuda:
        # grouped_mm needs 16-byte aligned strides: bf16 rows a multiple of 8 elements
        ok = x.dtype == torch.bfloat16 and d % 8 == 0 and h % 8 == 0 and o % 8 == 0
        return "grouped" if ok else "bmm"
    return "grouped" if x.dtype == torch.float32 and d % 4 == 0 and h % 4 == 0 and o % 4 == 0 else "loop"


def _mlp(x: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ W1 + b1) @ W2 + b2


def _dense(x, expert_idx, gate, W1, b1, W2, b2) -> torch.Tensor:
    hid = F.silu(torch.einsum("nd,edh->enh", x, W1) + b1[:, None, :])  # [E, N, h]
    y = torch.einsum("enh,eho->eno", hid, W2) + b2[:, None, :]  # [E, N, o]
    weight = torch.zeros(x.shape[0], W1.shape[0], dtype=y.dtype, device=x.device)  # [N, E]
    weight = weight.scatter_add(1, expert_idx, gate.to(y.dtype))
    return torch.einsum("ne,eno->no", weight, y)


def _loop(xs, counts, W1, b1, W2, b2) -> torch.Tensor:
    outs = []
    for e, seg in enumerate(torch.split(xs, counts.tolist())):
        if seg.shape[0]:
            outs.append(_mlp(seg, W1[e], b1[e], W2[e], b2[e]))
    if not outs:
        return xs.new_zeros(0, W2.shape[2])
    return torch.cat(outs)


def _bmm(xs, e_sorted, counts, W1, b1, W2, b2) -> torch.Tensor:
    n_exp = W1.shape[0]
    if xs.shape[0] == 0:
        return xs.new_zeros(0, W2.shape[2])
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts  # [E]
    slot = torch.arange(xs.shape[0], device=xs.device) - starts[e_sorted]  # row within its expert
    padded = xs.new_zeros(n_exp, width, xs.shape[1])  # [E, W, d]
    padded = padded.index_put((e_sorted, slot), xs)
    hid = F.silu(torch.bmm(padded, W1) + b1[:, None, :])  # [E, W, h]
    y = torch.bmm(hid, W2) + b2[:, None, :]  # [E, W, o]
    return y[e_sorted, slot]


def _grouped(xs, e_sorted, counts, W1, b1, W2, b2) -> torch.Tensor:
    if xs.shape[0] == 0:
        return xs.new_zeros(0, W2.shape[2])
    offs = torch.cumsum(counts, 0).to(torch.int32)  # end row of each expert's segment
    hid = torch._grouped_mm(xs.contiguous(), W1, offs=offs) + b1[e_sorted]  # [A, h]
    hid = F.silu(hid)
    return torch._grouped_mm(hid.contiguous(), W2, offs=offs) + b2[e_sorted]  # [A, o]
