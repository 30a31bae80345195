"""A closed-form correction of a translator's keys, read from every source layer (E108).

Each target layer of a translator reads the two source layers nearest to it in relative
depth. E108 fitted, per target layer, a ridge regression of the translator's key error
(native minus translated, before RoPE) on the K/V of *all* source layers, aligned to the
target tokens as the translator aligns its own inputs, and added it to the translated keys:
on held-out chunks of SmolLM2 -> Qwen2.5 the attention KL of the target's queries halved and
the answer probe rose. The same fit on the source layers the translator already reads made
the answers worse, so what helps is the information in the other layers, not a second guess
at the translator's own. Measured (docs/EXPERIMENTS.md E108): on fresh SQuAD questions at r = 0,
answer log-prob recovery +4.1 [+2.1, +6.1] points on SmolLM2 -> Qwen2.5; on the two Gemma-3
pairs the held-out probe falls. No shipped folder has the file yet: rank 1,024 keeps the gain
but costs 1.35-1.43x the r = 0 time to first token on a CPU.

The fit keeps every moment it needs in one pass (`RidgeAccumulator`): the standardised Gram
matrix is recovered from the raw sums. The mean key error is left out by default: adding it
is E84's offset, which cost the answers on every pair. The result is stored as a low-rank
product in raw feature units (`down [F, r]`, `up [r, O]`, `bias [O]`), so that applying it is
two matrix products on the aligned source features; `Translator` adds it to every
translation when its folder holds `KEY_RIDGE_FILE`.

Example:
    >>> acc = RidgeAccumulator()                                     # doctest: +SKIP
    >>> acc.add(features, native_keys - translated_keys)             # doctest: +SKIP
    >>> save_key_ridge(fit_key_ridge(acc, layers, lam=0.1), "my-translator/", source_layers)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from cagkv.errors import TranslatorError

__all__ = ["KEY_RIDGE_FILE", "RidgeAccumulator", "fit_key_ridge", "save_key_ridge", "load_key_ridge",
           "ridge_features", "apply_key_ridge"]

KEY_RIDGE_FILE = "key_ridge.safetensors"


class RidgeAccumulator:
    """Running sums over tokens of features `x [F]` and key errors `y [L, H*D]` (float64, each
    call's products in float32: add many chunks at once): enough to solve a ridge regression of
    `y` on standardised `x` without keeping the tokens."""

    def __init__(self) -> None:
        self.n = 0
        self.sx: torch.Tensor | None = None
        self.sxx: torch.Tensor | None = None
        self.sxy: torch.Tensor | None = None
        self.sy: torch.Tensor | None = None
        self.shape: tuple[int, ...] = ()  # the errors' [L, H*D], from the first call

    def add(self, features: torch.Tensor, errors: torch.Tensor) -> None:
        """Tokens of one or more chunks: features `[T, F]` and key errors `[T, L, H*D]` (native - translated)."""
        if features.ndim != 2 or errors.ndim != 3 or features.shape[0] != errors.shape[0]:
            raise ValueError(f"expected features [T, F] and errors [T, L, H*D] over the same tokens, got "
                             f"{list(features.shape)} and {list(errors.shape)}")
        x, y = features.float(), errors.reshape(errors.shape[0], -1).float()  # products in float32, sums in float64
        if self.sx is None:
            self.sx, self.sxx = x.sum(0).double(), (x.T @ x).double()
            self.sxy, self.sy = (x.T @ y).double(), y.sum(0).double()
            self.shape = tuple(errors.shape[1:])
        elif tuple(errors.shape[1:]) != self.shape or x.shape[1] != self.sx.shape[0]:
            raise ValueError(f"chunk of {x.shape[1]} features and errors {list(errors.shape[1:])}, earlier ones "
                             f"{self.sx.shape[0]} and {list(self.shape)}")
        else:
            self.sx += x.sum(0).double()
            self.sxx += (x.T @ x).double()  # type: ignore[operator]
            self.sxy += (x.T @ y).double()  # type: ignore[operator]
            self.sy += y.sum(0).double()  # type: ignore[operator]
        self.n += x.shape[0]


def fit_key_ridge(acc: RidgeAccumulator, layers: Sequence[int], lam: float = 0.1, rank: int = 0,
                  with_mean: bool = False) -> dict[str, torch.Tensor]:
    """Ridge of the errors of target `layers` on the standardised features, strength `lam`
    times the mean diagonal of the standardised Gram matrix. Returned in raw feature units as
    `{"down" [F, r], "up" [r, len(layers)*H*D], "bias", "layers"}`; `rank` 0 keeps every
    direction, else the top `rank` singular directions of the weight."""
    if acc.sx is None or acc.n < 2:
        raise ValueError("need at least two tokens added")
    n, L = acc.n, acc.shape[0]
    layers = list(layers)
    if not layers or min(layers) < 0 or max(layers) >= L:
        raise ValueError(f"layers must be in 0..{L - 1}, got {layers}")
    width = acc.shape[1]
    cols = torch.cat([torch.arange(l * width, (l + 1) * width) for l in layers])
    mu, ym = acc.sx / n, acc.sy[cols] / n  # type: ignore[index]
    gram = acc.sxx - n * torch.outer(mu, mu)  # type: ignore[operator]
    sd = (gram.diagonal() / (n - 1)).clamp(min=1e-8).sqrt()
    gz = gram / torch.outer(sd, sd)
    xty = (acc.sxy[:, cols] - n * torch.outer(mu, ym)) / sd[:, None]  # type: ignore[index]
    eye = torch.eye(gz.shape[0], dtype=gz.dtype)
    wz = torch.linalg.solve(gz + lam * gz.diagonal().mean() * eye, xty)
    w = wz / sd[:, None]  # raw units: y ~ (x - mu) @ w (+ ym)
    bias = -(mu @ w) + (ym if with_mean else 0)
    if rank and rank < min(w.shape):
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        down, up = u[:, :rank] * s[:rank], vh[:rank]
    else:
        down, up = w, torch.eye(w.shape[1], dtype=w.dtype)
    return {"down": down.float(), "up": up.float(), "bias": bias.float(), "layers": torch.tensor(layers)}


def save_key_ridge(ridge: dict[str, torch.Tensor], folder: str | Path, source_layers: Sequence[int],
                   dtype: torch.dtype = torch.float16) -> Path:
    """Write the correction beside a translator's weights (`KEY_RIDGE_FILE`), with the source
    layers whose K/V (in that order) make its features; its two factors in `dtype` (half the
    bytes of float32 by default: they are read in float32)."""
    from safetensors.torch import save_file

    path = Path(folder) / KEY_RIDGE_FILE
    tensors = {k: (v.to(dtype) if k in ("down", "up") else v).contiguous() for k, v in ridge.items()}
    tensors["source_layers"] = torch.tensor(list(source_layers))
    save_file(tensors, str(path))
    return path


def load_key_ridge(folder: str | Path, src_layers: int, src_kv_dim: int, tgt_layers: int,
                   tgt_kv_dim: int) -> dict[str, torch.Tensor] | None:
    """The correction saved in `folder`, checked against the pair's shapes, or None without a file."""
    from cagkv.translate.sidecar import read_tensors

    path = Path(folder) / KEY_RIDGE_FILE
    saved = read_tensors(path, ("down", "up", "bias", "layers", "source_layers"), "key ridge")
    if saved is None:
        return None
    src, layers = saved["source_layers"].tolist(), saved["layers"].tolist()
    down, up, bias = (saved[k].float() for k in ("down", "up", "bias"))
    features, out = len(src) * 2 * src_kv_dim, len(layers) * tgt_kv_dim
    ok = (src and layers and min(src) >= 0 and max(src) < src_layers and min(layers) >= 0
          and max(layers) < tgt_layers and down.shape[0] == features and up.shape == (down.shape[1], out)
          and bias.shape == (out,) and all(torch.isfinite(t).all() for t in (down, up, bias)))
    if not ok:
        raise TranslatorError(f"key ridge at {path}: finite down [{features}, r], up [r, {out}] and bias [{out}] "
                              f"over source layers < {src_layers} and target layers < {tgt_layers} expected; got "
                              f"down {list(down.shape)}, up {list(up.shape)}, bias {list(bias.shape)}, "
                              f"source layers {src}, target layers {layers}")
    return {"down": down, "up": up, "bias": bias, "layers": saved["layers"], "source_layers": saved["source_layers"]}


def ridge_features(keys: torch.Tensor, values: torch.Tensor, src_offsets: torch.Tensor, tgt_offsets: torch.Tensor,
                   source_layers: Sequence[int]) -> torch.Tensor:
    """The correction's features `[T, F]`: a source block's position-free K/V `[Ls, H, S, D]` of
    `source_layers`, pooled onto the target tokens as the translator pools its own inputs."""
    from cagkv.align import align_tokens
    from cagkv.translate.features import source_features

    feats = source_features(keys, values, list(source_layers))
    return align_tokens(src_offsets, tgt_offsets).to(feats.device) @ feats


def apply_key_ridge(keys: torch.Tensor, features: torch.Tensor, ridge: dict[str, torch.Tensor]) -> torch.Tensor:
    """Position-free keys `[L, H, T, D]` plus the correction of `features [T, F]` on the fitted
    layers, added in float32 and rounded once to the keys' dtype."""
    n_layers, heads, t, d = keys.shape
    dev = keys.device
    delta = (features.float() @ ridge["down"].to(dev)) @ ridge["up"].to(dev) + ridge["bias"].to(dev)  # [T, Lc*H*D]
    layers = ridge["layers"].to(dev)
    out = keys.to(torch.float32, copy=True)  # never the caller's tensor
    out[layers] += delta.reshape(t, len(layers), heads, d).permute(1, 2, 0, 3)
    return out.to(keys.dtype)
