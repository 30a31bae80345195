"""Shared fixtures: tiny random models for every supported family, and the real zoo models.

- `tiny(family)` / the parametrised `tiny_lm` fixture: a `TinyLM(model, config, spec,
  family)` built from a config (no files), fp32, eval mode, seeded. Gemma-3's tiny model
  has a sliding window of 8 tokens on 3 of its 4 layers, q/k-norm and two RoPE bases.
- `real_model(name, dtype=torch.float32)`: the converted zoo model from
  `$CAGKV_HOME/models/NAME`, loaded once per session (via `cagkv.models.load`'s cache);
  the test is skipped with a reason when the model has not been pulled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


from tiny_lms import (  # noqa: F401
    REAL_LMS,
    ROPE_FAMILIES,
    TINY_FAMILIES,
    TinyLM,
    capture_pre_rope_keys,
    tiny,
)


@pytest.fixture(params=TINY_FAMILIES)
def tiny_lm(request: pytest.FixtureRequest) -> TinyLM:
    return tiny(request.param)


@pytest.fixture(params=ROPE_FAMILIES)
def tiny_rope_lm(request: pytest.FixtureRequest) -> TinyLM:
    return tiny(request.param)


@pytest.fixture(scope="session")
def real_model() -> Callable[..., Any]:
    """`real_model(name, dtype=torch.float32) -> LoadedModel`, skipping when not pulled."""
    from cagkv.models import load, zoo

    def get(name: str, dtype: torch.dtype = torch.float32) -> Any:
        if not zoo.is_present(name):
            pytest.skip(
                f"real model {name} is not in {zoo.models_dir()}: run `cagkv models pull {name}`"
            )
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        return load(name, dtype=dtype)

    return get


@pytest.fixture
def pre_rope_keys() -> Callable[..., Any]:
    return capture_pre_rope_keys
