"""Cross-tokenizer alignment: source tokens onto the target's token grid by character overlap.

Both tokenizers split the *same* chunk text; each token carries its character span
`(start, end)` in that text (HF fast tokenizers' `offset_mapping`). Target token t pools
source token s with weight proportional to the number of characters their spans share.
A target token that overlaps no source token (an empty span such as a special token, or
a span over characters the source tokenizer dropped) takes the nearest source token.

Model-agnostic: only spans are used, never token strings, so byte-fallback pieces (several
tokens sharing one character span), whitespace runs and multi-byte unicode all work.

Example:
    >>> w = align_tokens(src_offsets, tgt_offsets)   # [T, S], rows sum to 1
    >>> tgt_feats = w @ src_feats                     # [T, F] from [S, F]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["align_tokens", "token_offsets"]


def align_tokens(src_offsets: torch.Tensor, tgt_offsets: torch.Tensor) -> torch.Tensor:
    """Pooling weights `[T, S]` (float32, rows sum to 1) from source to target tokens.

    Args:
        src_offsets: `[S, 2]` int character spans of the source tokens.
        tgt_offsets: `[T, 2]` int character spans of the target tokens (same text).
    """
    src = torch.as_tensor(src_offsets, dtype=torch.int64).reshape(-1, 2)  # [S, 2]
    tgt = torch.as_tensor(tgt_offsets, dtype=torch.int64).reshape(-1, 2)  # [T, 2]
    n_src, n_tgt = src.shape[0], tgt.shape[0]
    if n_tgt == 0:
        return torch.zeros(0, n_src)
    if n_src == 0:
        raise ValueError("cannot align onto an empty source: the source block has no tokens")
    s0, s1 = src[:, 0][None, :], src[:, 1][None, :]  # [1, S]
    t0, t1 = tgt[:, 0][:, None], tgt[:, 1][:, None]  # [T, 1]
    overlap = (torch.minimum(s1, t1) - torch.maximum(s0, t0)).clamp(min=0).to(torch.float32)  # [T, S]
    # Nearest source token for target rows without overlap: gap between spans (0 when they
    # touch or contain each other); ties go to the source token whose start is closest.
    gap = torch.maximum(s0 - t1, t0 - s1).clamp(min=0)  # [T, S]
    tie = (s0 - t0).abs()
    score = gap * (4 * (int(tgt.max().clamp(min=1)) + int(src.max().clamp(min=1)) + 1)) + tie
    nearest = score.argmin(dim=1)  # [T]
    rows = overlap.sum(dim=1)  # [T]
    empty = rows <= 0
    if bool(empty.any()):
        overlap[empty] = 0.0
        overlap[empty, nearest[empty]] = 1.0
        rows = overlap.sum(dim=1)
    return overlap / rows[:, None]


def token_offsets(tokenizer: Any, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[T]` and character spans `[T, 2]` (int64) of `text`, no special tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return _as_tensors(enc["input_ids"], enc["offset_mapping"], text)


def token_offsets_many(tokenizer: Any, texts: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`token_offsets` of each text, from one batched tokenizer call (the fast tokenizers
    encode a batch in parallel, without a Python round trip per text)."""
    if not texts:
        return []
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return [_as_tensors(ids, spans, text) for text, ids, spans in zip(texts, enc["input_ids"], enc["offset_mapping"])]


def _as_tensors(ids: Sequence[int], spans: Sequence[Sequence[int]], text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A tokenizer's ids and offset mapping of `text` -> int64 ids `[T]` and clipped spans `[T, 2]`."""
    offsets = torch.tensor([list(o) for o in spans], dtype=torch.int64).reshape(-1, 2)
    return torch.tensor(list(ids), dtype=torch.int64), _clip_offsets(offsets, len(text))


def _clip_offsets(offsets: torch.Tensor, n_chars: int) -> torch.Tensor:
    """Keep spans inside the text and non-decreasing within each span."""
    offsets = offsets.clamp(min=0, max=n_chars)
    offsets[:, 1] = torch.maximum(offsets[:, 1], offsets[:, 0])
    return offsets


def pool(weights: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Pool per-source-token features `[..., S, F]` onto target tokens: `[..., T, F]`."""
    return torch.matmul(weights.to(feats.dtype), feats)


def spans_from_pieces(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Spans of consecutive text pieces (a helper for tests and simple tokenizers)."""
    out, pos = [], 0
    for p in pieces:
        out.append((pos, pos + len(p)))
        pos += len(p)
    return out
