"""Which target tokens a translator gets wrong: a per-token-id table of its expected K/V error.

The translation error is not spread evenly over a chunk (docs/EXPERIMENTS.md E68): word
pieces, digits and names are translated worse than function words, and making a third of
the tokens exact closes most of the gap when that third is the one with the largest error.
The error itself needs the native cache, so it cannot be measured at question time, but
much of it is predicted by the target token alone. `fit_difficulty` runs a translator over
paired chunks (what the target computes natively is in the pairs) and averages each token
id's error, shrunk towards a prior for rare ids; `Translator.difficulty` reads the table
back and refresh can rank chunk tokens by it (`cagkv.refresh`, scorings "difficulty",
"contrast_difficulty", "union" and "adaptive").

Example:
    >>> table = fit_difficulty(trainer, trainer.pairs)          # doctest: +SKIP
    >>> save_difficulty(table, "my-translator/")                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cagkv.errors import TranslatorError

if TYPE_CHECKING:
    from cagkv.translate.pairs import PairSet
    from cagkv.translate.train import Trainer

__all__ = ["DIFFICULTY_FILE", "PRIORS", "token_errors", "fit_difficulty", "save_difficulty", "load_difficulty",
           "card_record"]

DIFFICULTY_FILE = "difficulty.safetensors"
# what a refit keeps of the card's former record: adaptive's switch is tuned on the contrast
# score's peakedness (cagkv.refresh.peakedness), which the table does not enter (E77)
KEPT_ON_REFIT = ("peak_z", "peak_z_from")
PRIOR_COUNT = 3.0  # an id seen n times weighs its own mean n / (n + 3) against the prior (PRIORS)


def token_errors(keys: torch.Tensor, values: torch.Tensor, native_keys: torch.Tensor, native_values: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Per-token translation error `[B, T]` (0 on padding) of K/V `[B, L, H, T, D]`: each layer's
    squared error over the mean squared norm of that chunk's native entries in the layer,
    summed over layers (so every layer weighs alike whatever its scale)."""
    m = mask.to(keys.dtype)[:, None, :]  # [B, 1, T]
    total = keys.new_zeros(mask.shape)
    for got, want in ((keys, native_keys), (values, native_values)):
        error = (got.float() - want.float()).pow(2).sum(dim=(2, 4))  # [B, L, T]
        scale = (want.float().pow(2).sum(dim=(2, 4)) * m).sum(-1) / m.sum(-1).clamp_min(1)  # [B, L]
        total = total + (error / scale.clamp_min(1e-12)[..., None] * m).sum(1)
    return total


PRIORS = ("singletons", "mean")


@torch.no_grad()
def fit_difficulty(trainer: Trainer, pairs: PairSet | Sequence[PairSet], vocab_size: int | None = None,
                   progress: bool = False, prior: str = "singletons") -> dict[str, torch.Tensor]:
    """Translate every chunk of `pairs` (one pair set or several) with `trainer.mot` and
    average the error per target token id.

    Rare ids are shrunk towards a prior, which is also what ids never seen get: `prior=
    "singletons"` the mean error of the ids seen once (rare ids are translated worse than
    common ones, E70, and an id never seen is rarer still), `"mean"` the mean over all
    tokens (E69's tables). Returns `{"difficulty": [V]` expected error over the mean error
    (1.0 = an average token), `"count": [V]` how often each id was seen}."""
    from tqdm.auto import tqdm

    if prior not in PRIORS:
        raise TranslatorError(f"unknown difficulty prior {prior!r}; one of {', '.join(PRIORS)}")
    sets = [pairs] if not isinstance(pairs, (list, tuple)) else list(pairs)
    vocab = int(vocab_size or trainer.target.config.vocab_size)
    total, count = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    trainer.mot.train(False)
    chunks = [(s, i) for s in sets for i in range(len(s))]
    for pair_set, i in tqdm(chunks, desc="difficulty", disable=not progress):
        bt = trainer.batch([pair_set[i]])
        keys, values, _ = trainer.translate_batch(bt)
        err = token_errors(keys, values, trainer.native_keys(bt), trainer.native_keys(bt, "tv"), bt["mask"])
        ids, valid = bt["ids"][bt["mask"]], err[bt["mask"]].double()
        if int(ids.max()) >= vocab:
            raise TranslatorError(f"token id {int(ids.max())} outside the target's vocabulary of {vocab}")
        total.index_add_(0, ids, valid)
        count.index_add_(0, ids, torch.ones_like(valid))
    if not count.sum():
        raise TranslatorError("no chunk tokens to fit a difficulty table on")
    mean = total.sum() / count.sum()
    if not mean > 0:  # an exact translator: no token is harder than another
        return {"difficulty": torch.ones(vocab), "count": count.float()}
    once = count == 1
    centre = total[once].mean() if prior == "singletons" and bool(once.any()) else mean
    shrunk = (total + PRIOR_COUNT * centre) / (count + PRIOR_COUNT)
    return {"difficulty": (shrunk / mean).float(), "count": count.float()}


def save_difficulty(table: dict[str, torch.Tensor], folder: str | Path) -> Path:
    """Write the table beside a translator's weights (`DIFFICULTY_FILE`), counts as integers."""
    from safetensors.torch import save_file

    path = Path(folder) / DIFFICULTY_FILE
    kinds = {"difficulty": torch.float32, "count": torch.int32}
    save_file({k: v.to(kinds.get(k, v.dtype)).contiguous() for k, v in table.items()}, str(path))
    return path


def card_record(table: dict[str, torch.Tensor], pairs_dirs: Sequence[str], chunks: int, prior: str,
                previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The card's `difficulty` record for a fitted `table`. Of a `previous` record only the
    switch threshold is kept (`KEPT_ON_REFIT`): its counts, range and note described the old table."""
    seen = table["count"] > 0
    d = table["difficulty"][seen]
    kept = {k: v for k, v in (previous or {}).items() if k in KEPT_ON_REFIT}
    return {
        "file": DIFFICULTY_FILE, "pairs_dirs": [str(p) for p in pairs_dirs], "chunks": int(chunks), "prior": prior,
        "ids_seen": int(seen.sum()), "tokens": int(table["count"].sum()),
        "range_seen": [round(float(d.min()), 3), round(float(d.max()), 3)] if len(d) else [],
        "how": "benchmarks/fit_difficulty.py (docs/EXPERIMENTS.md E69)", **kept,
    }


def load_difficulty(folder: str | Path) -> torch.Tensor | None:
    """The `[V]` difficulty table saved in `folder`, or None when it has none."""
    from cagkv.translate.sidecar import read_tensors

    path = Path(folder) / DIFFICULTY_FILE
    saved = read_tensors(path, ("difficulty",), "difficulty table")
    if saved is None:
        return None
    table = saved["difficulty"]
    if table.dim() != 1 or not torch.isfinite(table).all() or bool((table < 0).any()):
        raise TranslatorError(f"difficulty table at {path} must be one finite, non-negative value per token id")
    return table.float()
