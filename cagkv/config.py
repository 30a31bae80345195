"""Strict construction of config dataclasses from dicts (cards, CLI `--config`): unknown keys are errors."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def strict_from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """`cls(**data)`, refusing keys `cls` does not have, with the allowed names in the message."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; expected some of {sorted(names)}")
    return cls(**data)
