"""Tensor files saved beside a translator's weights (difficulty table, K/V offsets, attention fit), read one way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cagkv.errors import TranslatorError

__all__ = ["read_tensors"]


def read_tensors(path: Path, names: tuple[str, ...], what: str) -> dict[str, torch.Tensor] | None:
    """The tensors `names` of the safetensors file at `path`, or None where there is no file;
    `TranslatorError` ("`what` at `path` is unreadable") where it is truncated, not safetensors
    or lacks one of them. Checking shapes and values is the caller's."""
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        saved: Any = load_file(str(path))
        return {name: saved[name] for name in names}
    except Exception as e:  # noqa: BLE001 - truncated / not safetensors / no such tensor
        raise TranslatorError(f"{what} at {path} is unreadable: {str(e).splitlines()[0]}") from None
