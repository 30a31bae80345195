"""Set-up shared by the scripts that fit a question-time table beside a translator's weights.

`benchmarks/fit_kv_bias.py` and `benchmarks/fit_attention_bias.py` both copy a translator
folder to `--out` (without the table being fitted, so it is measured on the folder's own
translation; `benchmarks/fit_difficulty.py` copies the same way), ingest held-out contexts with the canonical model into a temporary store and run
the real engine over them; the record of the fit goes into the copied card with
`cagkv.translate.artifact.add_card_record`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cagkv.eval.runner import EvalConfig, default_store_factory, ingest_contexts
from cagkv.translate.artifact import CARD


def copy_translator(src: str | Path, out: str | Path, drop: str) -> Path:
    """Copy the translator folder `src` to `out`, leaving out any earlier `drop` file there."""
    out = Path(out).expanduser()
    if not (Path(src) / CARD).is_file():
        raise SystemExit(f"{src}: not a translator folder (no {CARD})")
    shutil.copytree(src, out, dirs_exist_ok=True)
    (out / drop).unlink(missing_ok=True)
    return out


@dataclass
class FitBench:
    """The engine with `translator` as its only translator, and the ingested contexts."""

    engine: Any
    canonical: str
    target: str
    documents: list[str]


@contextmanager
def fit_bench(translator: Any, dataset: str, texts: Sequence[str], prefix: str,
              progress: bool = True) -> Iterator[FitBench]:
    """Ingest `texts` with the translator's canonical model into a temporary store (removed on
    exit) and yield the engine over it, every question routed to `translator`."""
    from cagkv.pipeline import CAG

    canonical, target = translator.card["source"]["name"], translator.card["target"]["name"]
    config = EvalConfig(dataset=dataset, canonical=canonical, target=target)
    with tempfile.TemporaryDirectory() as tmp:
        store = default_store_factory(config)(Path(tmp) / "store")
        engine = CAG(store, canonical=canonical, find_translator=lambda src, tgt: translator)
        documents = ingest_contexts(store, list(texts), config, prefix=prefix, progress=progress)
        yield FitBench(engine, canonical, target, documents)
