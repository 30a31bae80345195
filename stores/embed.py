"""Embedders: text -> L2-normalised float32 vectors for the FAISS index.

- `MiniLMEmbedder(path)`: all-MiniLM-L6-v2 (384-d) through transformers' AutoModel,
  mean pooling over the attention mask, then L2 norm (what sentence-transformers does
  for this model). Loads only from a local folder (zoo name `minilm-l6` by default).
- `HashEmbedder(dim)`: deterministic bag of hashed words, for tests (no model files);
  texts that share words get similar vectors, so retrieval tests are meaningful.

`make_embedder(name)` maps a recorded embedder name back to an instance.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from cagkv.errors import UsageError

DEFAULT_EMBEDDER = "minilm-l6"


class Embedder(Protocol):
    """`embed(texts) -> float32 [N, dim]`, each row L2-normalised."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero), float32."""
    x = np.asarray(x, dtype=np.float32)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.where(n > 0, n, 1.0)).astype(np.float32)


class HashEmbedder:
    """Signed feature hashing of lower-cased words (and word bigrams) into `dim` buckets."""

    def __init__(self, dim: int = 64) -> None:
        self.dim = int(dim)
        self.name = f"hash-{self.dim}"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [N, dim]
        for i, text in enumerate(texts):
            words = re.findall(r"\w+", text.lower())
            for feat in words + [a + " " + b for a, b in zip(words, words[1:], strict=False)]:
                h = int.from_bytes(hashlib.blake2b(feat.encode("utf-8", "replace"), digest_size=8).digest(), "little")
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        return normalise(out)


class MiniLMEmbedder:
    """Sentence embeddings from a local MiniLM folder (mean pooling + L2 norm)."""

    def __init__(self, path: str | None = None, batch_size: int = 32, max_length: int = 256) -> None:
        self.path = path or _resolve(DEFAULT_EMBEDDER)
        self.name = DEFAULT_EMBEDDER if path is None else str(path)
        self.batch_size = batch_size
        self.max_length = max_length
        self._model: Any = None
        self._tok: Any = None
        self.dim = 384 if path is None else int(_read_hidden_size(self.path))

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self._model = AutoModel.from_pretrained(self.path, local_files_only=True).eval()
        self.dim = int(self._model.config.hidden_size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        self._load()
        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = list(texts[i : i + self.batch_size])
            enc = self._tok(batch, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
            with torch.inference_mode():
                h = self._model(**enc).last_hidden_state  # [B, T, dim]
            mask = enc["attention_mask"].unsqueeze(-1).to(h.dtype)  # [B, T, 1]
            pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [B, dim]
            out.append(pooled.float().numpy())
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return normalise(np.concatenate(out, axis=0))


def make_embedder(name: str) -> Embedder:
    """`minilm-l6` | `hash-<dim>` | a local model folder -> an Embedder."""
    match name:
        case "minilm-l6":
            return MiniLMEmbedder()
        case _ if re.fullmatch(r"hash-\d{1,5}", name):
            return HashEmbedder(int(name.split("-")[1]))
        case _:
            from pathlib import Path

            if Path(name).is_dir():
                return MiniLMEmbedder(name)
            raise UsageError(f"unknown embedder {name!r}: expected one of minilm-l6, hash-<dim>, a model folder")


def _resolve(name: str) -> str:
    try:
        from cagkv.models.zoo import resolve
    except ImportError:  # the zoo is optional for the store
        import os
        from pathlib import Path

        home = Path(os.environ.get("CAGKV_HOME", "~/.cache/cagkv")).expanduser()
        return str(home / "models" / name)
    return resolve(name)


def _read_hidden_size(path: str) -> int:
    import json
    from pathlib import Path

    try:
        return int(json.loads((Path(path) / "config.json").read_text())["hidden_size"])
    except (OSError, KeyError, ValueError):
        raise UsageError(f"{path} is not an embedding model folder (no config.json with hidden_size)") from None
