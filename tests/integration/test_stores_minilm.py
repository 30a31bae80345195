"""The store with the real MiniLM embedder: semantic retrieval without shared words."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))

pytestmark = pytest.mark.integration

MODEL = Path(os.environ.get("CAGKV_HOME", "~/.cache/cagkv")).expanduser() / "models" / "minilm-l6"


@pytest.fixture(scope="module")
def embedder():
    if not (MODEL / "model.safetensors").is_file():
        reason = f"minilm-l6 is not in {MODEL.parent} (run `cagkv models pull minilm-l6`)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    from cagkv.stores.embed import MiniLMEmbedder

    return MiniLMEmbedder(str(MODEL))


def test_minilm_embeddings_normalised_and_semantic(embedder):
    v = embedder.embed(["The cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply."])
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.4 > v[0] @ v[2]
    assert np.allclose(embedder.embed(["The cat sits on the mat."])[0], v[0], atol=1e-5)  # padding-independent


def test_store_retrieves_by_meaning(embedder, tmp_path: Path):
    from cagkv.stores import CacheStore
    from storekit import chunked

    s = CacheStore.open(tmp_path / "s", canonical="tiny", fingerprint="fp-reliability-01", embedder=embedder)
    docs = {
        "astro.txt": "The telescope observed a distant galaxy. Astronomers measured its redshift.",
        "cook.txt": "Whisk the eggs with sugar. Bake the cake for forty minutes.",
        "law.txt": "The court dismissed the appeal. The judge cited an earlier ruling.",
    }
    for src, text in docs.items():
        s.add_document(src, text, {}, chunked(text))
    assert s.search("How long should the dessert stay in the oven?", k=1)[0].source == "cook.txt"
    assert s.search("what did scientists find about far-away star systems", k=1)[0].source == "astro.txt"
    assert s.stats()["embedder"] == str(MODEL)
