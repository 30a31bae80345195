"""Answer-quality metrics and their intervals: pure functions, no model code.

- `exact_match`, `token_f1`: SQuAD v1.1 scoring (official normalisation: lower-case, drop
  punctuation and the articles a/an/the, collapse whitespace), best over every gold answer.
- `bootstrap_mean`: the mean with a percentile bootstrap 95 % interval.
- `recovery`: (mode - none) / (native - none) of the means, with a paired bootstrap interval
  (the same resampled examples for the three modes, so per-example difficulty cancels).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, remove punctuation, articles and extra whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in golds))


def token_f1(prediction: str, golds: Iterable[str]) -> float:
    """Best token-overlap F1 between the prediction and any gold answer (SQuAD v1.1)."""
    return max((_f1(prediction, gold) for gold in golds), default=0.0)


def _f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        # Both empty counts as a match (the official script's convention for no-answer).
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def answer_span(generated: str) -> str:
    """The part of a generation that is scored: its first non-empty line, stripped.

    Small models often continue past the answer ("Denver Broncos\\nQuestion: ..."); the
    first line is what a reader takes as the answer.
    """
    for line in generated.splitlines():
        if line.strip():
            return line.strip()
    return ""


@dataclass(frozen=True)
class Interval:
    """A point estimate with a bootstrap interval; NaN where undefined."""

    value: float
    lo: float
    hi: float

    def as_list(self) -> list[float | None]:
        """`[lo, hi]` with NaN written as None (JSON has no NaN)."""
        return [_finite_or_none(self.lo), _finite_or_none(self.hi)]


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _as_array(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return math.nan, math.nan
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(samples, [tail, 100 - tail])
    return float(lo), float(hi)


def bootstrap_mean(
    values: Sequence[float | None], n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> Interval:
    """Mean of the values (None/NaN dropped) with a percentile bootstrap interval."""
    x = _as_array(values)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))  # [B, N] resampled example indices
    lo, hi = _percentiles(x[idx].mean(axis=1), level)
    return Interval(float(x.mean()), lo, hi)


def recovery_ratio(mode: float, none: float, native: float) -> float:
    """(mode - none) / (native - none); NaN when native and none are equal."""
    gap = native - none
    if not math.isfinite(gap) or abs(gap) < 1e-12:
        return math.nan
    return (mode - none) / gap


def _gap_ratio(num: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """`num / gap`, NaN where the gap is (near) zero; element-wise on arrays or scalars."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.abs(gap) < 1e-12, np.nan, num / gap)


def _paired_bootstrap(
    columns: Sequence[Sequence[float | None]],
    statistic: Callable[[np.ndarray], np.ndarray],
    n_boot: int,
    seed: int,
    level: float,
) -> Interval:
    """`statistic` of the column means (`[k]`, or `[k, B]` for B resamples) with a paired
    bootstrap interval: every resample draws the same examples for all columns. Examples
    missing (None/NaN) in any column are dropped."""
    if len({len(c) for c in columns}) > 1:
        raise ValueError(f"paired values need equal lengths, got {', '.join(str(len(c)) for c in columns)}")
    table = np.stack([_as_array(c) for c in columns])  # [k, N]
    table = table[:, np.isfinite(table).all(axis=0)]
    n = table.shape[1]
    if n == 0:
        return Interval(math.nan, math.nan, math.nan)
    value = float(statistic(table.mean(axis=1)))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))  # [B, N]
    lo, hi = _percentiles(statistic(table[:, idx].mean(axis=2)), level)
    return Interval(value, lo, hi)


def recovery(
    mode: Sequence[float | None],
    none: Sequence[float | None],
    native: Sequence[float | None],
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Recovery of `mode` between `none` (0) and `native` (1), with a paired bootstrap interval.

    The three sequences are per-example values of the same examples in the same order;
    examples missing in any of them are dropped.
    """
    return _paired_bootstrap([mode, none, native], lambda m: _gap_ratio(m[0] - m[1], m[2] - m[1]),
                             n_boot, seed, level)


def recovery_difference(
    a: Sequence[float | None],
    b: Sequence[float | None],
    none: Sequence[float | None],
    native: Sequence[float | None],
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    native_b: Sequence[float | None] | None = None,
) -> Interval:
    """Recovery of `a` minus recovery of `b` on the same examples, with a paired bootstrap
    interval (each resample draws the same examples for every column), so two modes
    whose separate intervals overlap can still be told apart. `native_b`: the reference `b`
    recovers against where it is not `native` (each mode against native run its own way)."""

    def difference(m: np.ndarray) -> np.ndarray:
        return _gap_ratio(m[0] - m[2], m[3] - m[2]) - _gap_ratio(m[1] - m[2], m[4] - m[2])

    return _paired_bootstrap([a, b, none, native, native if native_b is None else native_b], difference,
                             n_boot, seed, level)
