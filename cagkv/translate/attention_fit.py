"""An attention bias per target layer and head, fitted to native prefill's attention shares (docs/EXPERIMENTS.md E95).

A question gives a translated chunk a different share of its attention than the same chunk
prefilled natively, and the gap differs by layer and head (E84 measured only the sum). An
additive bias `b` on a chunk's attention logits moves one layer's share `s` to
`s e^b / (s e^b + 1 - s)`, so `b = logit(native share) - logit(translated share)` matches that
layer's share while its inputs stay as they were; a bias in the lower layers changes the
inputs of the upper ones, so the fit runs in rounds, each measuring the shares under the table
so far and adding the gap left. The table (`[L, H]`, target layers by query heads) is written
beside a translator's weights (`ATTENTION_FIT_FILE`) and read by `Translator.attention_fit`; the
bias scope word "fitted" (`cagkv.models.layers.parse_bias_scope`) makes a bias of value `v`
act as `v * table[layer, head]`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from cagkv.errors import TranslatorError
from cagkv.models.layers import AttentionBias, decoder_of, eager_attention, forward_at

__all__ = ["ATTENTION_FIT_FILE", "Fed", "FitCase", "chunk_shares", "fit_attention_bias", "save_attention_fit",
           "load_attention_fit"]

ATTENTION_FIT_FILE = "attention_bias_fit.safetensors"
_EDGE = 1e-4  # shares are clamped to [_EDGE, 1 - _EDGE] before their logit


class Fed(NamedTuple):
    """A cache of `n` positions and the tokens fed after it (a native prefill holds the chunk's
    separator; a translation feeds it with the question)."""

    cache: Any
    n: int
    prompt_ids: list[int]


class FitCase(NamedTuple):
    """One question over one chunk: the target `model`, its `native` and `translated` caches
    (the same positions in all), the translated chunk's `positions` and the count of fed tokens
    both end with (the question's), over which the shares are taken."""

    model: nn.Module
    native: Fed
    translated: Fed
    positions: torch.Tensor

    @property
    def question_tokens(self) -> int:
        a, b = self.native.prompt_ids, self.translated.prompt_ids
        k = min(len(a), len(b))
        if self.native.n + len(a) != self.translated.n + len(b) or a[len(a) - k:] != b[len(b) - k:]:
            raise ValueError("the native and the translated prompt must end at the same position with the same tokens")
        return k


@torch.inference_mode()
def chunk_shares(model: nn.Module, cache: Any, n: int, prompt_ids: Sequence[int], positions: torch.Tensor,
                 bias: AttentionBias | None = None, last: int | None = None) -> torch.Tensor:
    """The share `[L, H]` of each layer's and head's attention (over the cached keys and the
    prompt's own) that the prompt's tokens, fed after the `n` cached ones, give `positions`:
    the mean over the prompt's last `last` tokens (None: all). `cache` is not changed; `bias`
    acts as in the engine. Runs eager attention for this pass (the only kind that returns the weights)."""
    layers = decoder_of(model).layers
    weights: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            weights[i] = output[1]  # [1, H, Q, K]
        return hook

    handles = [layer.self_attn.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        with eager_attention(model):
            forward_at(model, list(prompt_ids), n, copy.deepcopy(cache), keep=1, bias=bias)
    finally:
        for handle in handles:
            handle.remove()
    if len(weights) != len(layers) or any(w is None for w in weights.values()):
        raise RuntimeError("the attention layers did not return their weights under eager attention")
    q = len(prompt_ids)
    rows = slice(q - (q if last is None else last), q)
    out = []
    for i in range(len(layers)):
        w = weights[i][0].float()  # [H, Q, K]: K = the held keys (a sliding layer may hold fewer) + the prompt's
        held = w.shape[-1] - q
        keys = torch.cat([torch.arange(n - held, n), n + torch.arange(q)]).to(w.device)
        hit = torch.isin(keys, positions.to(w.device))
        out.append(w[:, rows][:, :, hit].sum(-1).mean(-1))  # [H]
    return torch.stack(out).cpu()


def _logit(share: torch.Tensor) -> torch.Tensor:
    s = share.clamp(_EDGE, 1 - _EDGE)
    return torch.log(s) - torch.log1p(-s)


def fit_attention_bias(cases: Sequence[FitCase], rounds: int = 3, limit: float = 4.0,
                       progress: bool = False) -> dict[str, torch.Tensor]:
    """The table `[L, H]`: per round, the mean over `cases` of logit(native share) -
    logit(translated share under the table so far) is added to it (clamped to +-`limit`).
    Returns `{"bias", "native", "translated", "fitted"}`: the table, native's and the plain
    translation's mean shares, and the mean shares under the final table (a last measurement)."""
    from tqdm import tqdm

    if not cases:
        raise ValueError("no questions to fit an attention bias on")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    def shares_of(c: FitCase, fed: Fed, table: torch.Tensor | None) -> torch.Tensor:
        bias = None if table is None else AttentionBias(c.positions, 1.0, per_layer=table)
        return chunk_shares(c.model, fed.cache, fed.n, fed.prompt_ids, c.positions, bias, c.question_tokens)

    native = torch.stack([shares_of(c, c.native, None)
                          for c in tqdm(cases, desc="native shares", disable=not progress)])  # [N, L, H]
    table = torch.zeros(native.shape[1:])
    first = None
    for r in range(rounds + 1):
        shares = torch.stack([shares_of(c, c.translated, None if r == 0 else table)
                              for c in tqdm(cases, desc=f"translated shares, round {r}", disable=not progress)])
        if first is None:
            first = shares
        if r == rounds:
            break
        table = (table + (_logit(native) - _logit(shares)).mean(0)).clamp(-limit, limit)
    return {"bias": table.float(), "native": native.mean(0), "translated": first.mean(0), "fitted": shares.mean(0)}


def save_attention_fit(fit: dict[str, torch.Tensor], folder: str | Path) -> Path:
    """Write a fit's tensors beside a translator's weights (`ATTENTION_FIT_FILE`)."""
    from safetensors.torch import save_file

    path = Path(folder) / ATTENTION_FIT_FILE
    save_file({k: v.contiguous().float() for k, v in fit.items()}, str(path))
    return path


def load_attention_fit(folder: str | Path, layers: int) -> torch.Tensor | None:
    """The fitted table `[layers, H]` saved in `folder`, or None without a file."""
    from cagkv.translate.sidecar import read_tensors

    path = Path(folder) / ATTENTION_FIT_FILE
    saved = read_tensors(path, ("bias",), "attention bias fit")
    if saved is None:
        return None
    table = saved["bias"]
    if table.dim() != 2 or table.shape[0] != layers or not torch.isfinite(table).all():
        raise TranslatorError(f"attention bias fit at {path} must be finite, of shape [{layers}, heads] "
                              f"(the target's layers, query heads), got {list(table.shape)}")
    return table.float()
