"""Which source layers feed which target layer (relative depth), and target layer groups.

Target layer l sits at relative depth l / (L_t - 1); it reads the `nearest` source layers
closest to that depth in the source stack. Groups of consecutive target layers share a
sequence-mixing block and a router (the "layer-group" experts of DESIGN.md §4).

Example:
    >>> layer_map(30, 18, nearest=2)[17]
    [29, 28]
"""

from __future__ import annotations

__all__ = ["layer_map", "layer_groups", "used_source_layers"]


def layer_map(n_src: int, n_tgt: int, nearest: int = 2) -> list[list[int]]:
    """For each target layer, the `nearest` source layers by relative depth (closest first)."""
    if n_src < 1 or n_tgt < 1:
        raise ValueError(f"layer counts must be positive, got source {n_src}, target {n_tgt}")
    nearest = max(1, min(nearest, n_src))
    out: list[list[int]] = []
    for l in range(n_tgt):
        depth = l / (n_tgt - 1) if n_tgt > 1 else 1.0
        pos = depth * (n_src - 1)
        order = sorted(range(n_src), key=lambda j: (abs(j - pos), -j))
        out.append(order[:nearest])
    return out


def layer_groups(translated: list[int], group_size: int) -> list[list[int]]:
    """Consecutive target layers in groups of `group_size` (the last may be shorter)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [translated[i : i + group_size] for i in range(0, len(translated), group_size)]


def used_source_layers(lmap: list[list[int]], target_layers: list[int]) -> list[int]:
    """Sorted union of the source layers that the given target layers read."""
    return sorted({s for l in target_layers for s in lmap[l]})
