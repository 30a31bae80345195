"""Model facts and plumbing: the zoo, ModelSpec, RoPE per layer, HF cache <-> tensors, loading.

- `zoo`: named models (`ZOO`), `pull`, `list_models`, `resolve`, `home`.
- `spec`: `ModelSpec.from_config(config, tokenizer=None)`.
- `rope`: `RopeLayer`, `rotate`, `unrotate` (keys `[..., T, D]`, positions `[T]`).
- `cache`: `extract_kv`, `build_cache`, `append_kv`, `full_cache`.
- `loading`: `load(name_or_path, dtype) -> LoadedModel`.
- `fingerprint`: `model_fingerprint`, `folder_fingerprint`, `tokenizer_hash`.

Names are imported lazily so `import cagkv.models.zoo` (the CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZOO": "zoo", "ZooEntry": "zoo", "home": "zoo", "pull": "zoo", "list_models": "zoo",
    "resolve": "zoo", "model_path": "zoo", "is_present": "zoo",
    "ModelSpec": "spec", "UnsupportedModelError": "spec", "SUPPORTED_FAMILIES": "spec",
    "RopeLayer": "rope", "rotate": "rope", "unrotate": "rope", "rotate_layers": "rope",
    "unrotate_layers": "rope", "rope_layer_from_config": "rope",
    "extract_kv": "cache", "build_cache": "cache", "append_kv": "cache", "full_cache": "cache",
    "LoadedModel": "loading", "load": "loading", "clear_cache": "loading", "unload": "loading",
    "model_fingerprint": "fingerprint", "folder_fingerprint": "fingerprint", "tokenizer_hash": "fingerprint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"cagkv.models.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'cagkv.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
