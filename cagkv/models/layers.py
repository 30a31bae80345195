"""Run a slice of a decoder's layers from a given residual stream (the replay primitive).

`run_layers(model, hidden, positions, cache, start)` feeds `hidden` `[B, T, E]` (the
residual stream entering layer `start`) through layers `start..L-1` at `positions`,
appending each layer's keys/values to `cache` exactly as the model's own forward does
(same masks, same rotary embeddings per layer type). With `start=0` and the token
embeddings as `hidden` it is the model's forward, which the tests check bit for bit.

`forward_at(..., bias=AttentionBias(positions, value, until, kinds))` adds `value` to the
attention logits of the cached `positions` for the fed tokens before `until`, in every head of
the layers of the attention `kinds` (None: every layer; a chunk's tokens left translated:
docs/EXPERIMENTS.md E86, E87, E90); with a `per_layer` table `[L, H]` each layer's head reads
`value` times its entry (a bias fitted to native's attention shares, E95).

`inject_kv(cache, {layer: (keys_rotated, values)})` makes the named layers store and
attend over the given keys/values for the new tokens instead of the ones they compute
(the `mot-window` reference inference).

Example:
    >>> cache = prefix_cache_copy()
    >>> h = run_layers(model, boundary_hidden, torch.arange(P, P + T)[None], cache, start=12)
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["run_layers", "inject_kv", "decoder_of", "layer_types", "forward_at", "AttentionBias", "head_logits",
           "biased_masks", "BiasScope", "LAYER_WORDS", "parse_bias_scope", "eager_attention"]


class AttentionBias(NamedTuple):
    """`value` added to the attention logits of the cached tokens at `positions` (absolute): for
    the queries before position `until` (None: every query) in the layers of the attention kinds
    `kinds` (None: every layer), and for the queries from `until` on in the layers of `rest_kinds`
    (none by default)."""

    positions: torch.Tensor
    value: float
    until: int | None = None
    kinds: frozenset[str] | None = None
    rest_kinds: frozenset[str] = frozenset()
    per_layer: torch.Tensor | None = None  # [L, H]: layer i's head h reads value * per_layer[i, h] (E95)

    def acts_in(self, kind: str) -> bool:
        """Whether the layers of attention kind `kind` see any of the bias."""
        return self.value != 0 and ((self.kinds is None or kind in self.kinds)
                                    or (self.until is not None and kind in self.rest_kinds))

    def matrix(self, query_positions: torch.Tensor, key_positions: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        """The additive bias `[Q, K]` of queries at `query_positions` over keys at `key_positions`,
        in a layer of attention kind `kind` (None: as if every kind were named)."""
        device = key_positions.device
        hit = torch.isin(key_positions, self.positions.to(device)).to(torch.float32)
        early = kind is None or self.kinds is None or kind in self.kinds
        rows = torch.full((len(query_positions),), float(early), device=device)
        if self.until is not None:
            before = query_positions.to(device) < self.until
            rest = kind is None or kind in self.rest_kinds
            rows = torch.where(before, rows, torch.full_like(rows, float(rest)))
        return rows[:, None] * hit[None, :] * self.value

    def add_to(self, mask: torch.Tensor, extra: torch.Tensor, kind: str, types: list[str]) -> dict[str | int, torch.Tensor]:
        """The masks of the layers of kind `kind`: `mask` plus `extra` (this bias's additive part,
        broadcastable to `mask`): one mask for the kind without `per_layer`, else one per layer
        index of that kind, `extra` scaled per head by the layer's row."""
        if self.per_layer is None:
            return {kind: mask + extra}
        table = self.per_layer.to(device=mask.device, dtype=mask.dtype)
        out: dict[str | int, torch.Tensor] = {kind: mask}
        for i, t in enumerate(types):
            if t == kind:
                out[i] = mask + extra * table[i][:, None, None]  # [H, 1, 1]: one value per head
        return out


class BiasScope(NamedTuple):
    """Where an attention bias acts: `answer_tokens` (None: every fed token; K: the question's
    and the first K answer tokens), `kinds` (None: every layer; else the layers of those
    attention kinds) and `rest_kinds` (the layers in which the answer's later tokens read it too)."""

    answer_tokens: int | None = None
    kinds: frozenset[str] | None = None
    rest_kinds: frozenset[str] = frozenset()
    hard: float | None = None  # the share of the translated tokens the translator's difficulty table ranks hardest
    fitted: bool = False  # each layer and head scales the bias by the translator's fitted table (E95)


LAYER_WORDS = {"sliding": "sliding_attention", "full": "full_attention"}  # a scope's words for the layer kinds


def parse_bias_scope(scope: str) -> BiasScope:
    """An attention bias scope: comma-separated words, at most one for the queries ("all", every
    fed token; "question", the question's only; "answerK", the question's and the first K answer
    tokens'), one for the layers ("sliding" or "full": the layers of that attention kind only),
    and, with "question" or "answerK", one for the answer's later tokens ("rest:sliding" or
    "rest:full": they read the bias in the layers of that kind), as in "answer4,sliding" or
    "question,rest:full"; "hardF" (0 < F <= 1) keeps the bias to that share of the translated
    tokens, those the translator's difficulty table ranks hardest (E92); "fitted" scales the bias in
    each layer and head by the translator's fitted table (`cagkv.translate.attention_fit`, E95).
    ValueError for anything else."""
    queries: int | None = None
    kinds: frozenset[str] | None = None
    rest: frozenset[str] | None = None
    hard: float | None = None
    fitted = False
    seen_queries = False
    for word in scope.split(","):
        if word == "fitted" and not fitted:
            fitted = True
            continue
        if word.startswith("hard") and hard is None:
            try:
                hard = float(word[len("hard"):])
            except ValueError:
                hard = -1.0
            if not 0 < hard <= 1:
                raise ValueError(f"an attention bias scope's hardF takes a share in (0, 1], as in hard0.33, got {word!r}")
            continue
        if word in LAYER_WORDS and kinds is None:
            kinds = frozenset({LAYER_WORDS[word]})
            continue
        if word.startswith("rest:") and word[len("rest:"):] in LAYER_WORDS and rest is None:
            rest = frozenset({LAYER_WORDS[word[len("rest:"):]]})
            continue
        if not seen_queries and (word in ("all", "question")
                                 or (word.startswith("answer") and word[len("answer"):].isdigit())):
            seen_queries = True
            queries = None if word == "all" else 0 if word == "question" else int(word[len("answer"):])
            continue
        raise ValueError(f"an attention bias scope is all, question or answerK (K >= 0 answer tokens, as in answer4), "
                         f"optionally with sliding or full and, after question or answerK, rest:sliding or rest:full "
                         f"(as in answer4,sliding or question,rest:full), hardF or fitted, got {scope!r}")
    if rest is not None and queries is None:
        raise ValueError(f"an attention bias scope's rest:KIND names the answer tokens after question or answerK, "
                         f"got {scope!r}")
    return BiasScope(queries, kinds, rest or frozenset(), hard, fitted)


_EAGER_SWITCH = threading.Lock()


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """While active, `model` runs eager attention (the only implementation that returns the
    attention weights); its own is restored after. One switch at a time: two threads sharing a
    model must not restore each other's setting mid-pass (a forward of another thread meanwhile
    runs eager: slower, same result)."""
    with _EAGER_SWITCH:
        before = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            yield
        finally:
            model.set_attn_implementation(before)


def decoder_of(model: nn.Module) -> nn.Module:
    """The inner decoder (`model.model` of a *ForCausalLM) holding `layers`."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise TypeError(f"cannot find decoder layers in {type(model).__name__}")
    return inner


def layer_types(config: Any, n: int) -> list[str]:
    """Each layer's attention kind (`full_attention` / `sliding_attention`)."""
    types = getattr(config, "layer_types", None)
    return list(types) if types else ["full_attention"] * n


def _masks(config: Any, hidden: torch.Tensor, positions: torch.Tensor, cache: Any, kinds: set[str]) -> dict[str, Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = {"config": config, "inputs_embeds": hidden, "attention_mask": None, "cache": cache, "position_ids": positions}
    out: dict[str, Any] = {}
    for kind in kinds:
        out[kind] = create_sliding_window_causal_mask(**kw) if kind == "sliding_attention" else create_causal_mask(**kw)
    return out


def biased_masks(config: Any, hidden: torch.Tensor, positions: torch.Tensor, cache: Any, kinds: set[str],
                 types: list[str], bias: AttentionBias) -> dict[str | int, torch.Tensor]:
    """The model's own causal masks over `cache` (before `hidden` is added to it), made
    additive, with `bias` added to the columns of its positions (keyed by kind, and by layer
    index where the bias has a `per_layer` table); `cache` holds every position from 0 on (a
    sliding layer may have dropped the oldest: its offset says how many)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kw = {"config": config, "inputs_embeds": hidden, "attention_mask": None, "cache": cache, "position_ids": positions,
          "allow_is_causal_skip": False}
    out: dict[str | int, torch.Tensor] = {}
    for kind in kinds:
        make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        mask = make(**kw)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(hidden.dtype).min)
        _, offset = cache.get_mask_sizes(hidden.shape[1], types.index(kind))
        keys = int(offset) + torch.arange(mask.shape[-1], device=mask.device)
        if bias.acts_in(kind):
            out.update(bias.add_to(mask, bias.matrix(positions[0], keys, kind).to(mask.dtype), kind, types))
        else:
            out[kind] = mask
    return out


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's next-token logits from the residual stream after its last layer (final norm,
    LM head, and the logit soft-capping of the models that have it)."""
    logits = model.lm_head(decoder_of(model).norm(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _rotary(inner: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
    rot = inner.rotary_emb
    per_type = "layer_type" in inspect.signature(rot.forward).parameters
    if per_type:
        return {kind: rot(hidden, positions, kind) for kind in kinds}
    shared = rot(hidden, positions)
    return {kind: shared for kind in kinds}


def forward_at(model: nn.Module, ids: Any, start: int, cache: Any = None, keep: int = 1,
               bias: AttentionBias | None = None) -> Any:
    """The model's own forward of token `ids` at positions start.. into `cache` (a new one
    when None), on the model's device; `keep`: the last positions whose logits are computed
    (0: all). Returns the model's output (`.logits [1, keep or T, V]`, `.cache`). With `bias`
    (which needs `cache`) the same layers run with its value added to the attention logits
    of its cached positions."""
    device = next(model.parameters()).device
    positions = (start + torch.arange(len(ids), device=device))[None]  # [1, T]
    if bias is not None and bias.value != 0:
        if cache is None:
            raise ValueError("an attention bias needs a cache holding the positions it names")
        inner = decoder_of(model)
        types = layer_types(inner.config, len(inner.layers))
        hidden = model.get_input_embeddings()(torch.tensor([list(ids)], dtype=torch.long, device=device))
        masks = biased_masks(inner.config, hidden, positions, cache, set(types), types, bias)
        hidden = run_layers(model, hidden, positions, cache, 0, masks=masks)
        return _Output(head_logits(model, hidden if keep == 0 else hidden[:, -keep:]), cache)
    kwargs: dict[str, Any] = {"use_cache": True, "logits_to_keep": keep, "position_ids": positions}
    if cache is not None:
        kwargs["cache"] = cache
    return model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device), **kwargs)


class _Output(NamedTuple):
    logits: torch.Tensor
    cache: Any


def run_layers(
    model: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, cache: Any, start: int, stop: int | None = None,
    masks: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Layers `start..stop-1` over `hidden` `[B, T, E]` at `positions` `[B, T]`; returns the
    residual stream after them (before the final norm). `cache` receives their K/V.
    `masks`: an attention mask per layer kind (and, where given, per layer index), instead of
    the causal ones over `cache`."""
    inner = decoder_of(model)
    config = inner.config
    n = len(inner.layers)
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"layer range [{start}, {stop}) outside 0..{n}")
    types = layer_types(config, n)
    kinds = {types[i] for i in range(start, stop)}
    if not kinds:
        return hidden
    if masks is None:
        masks = _masks(config, hidden, positions, cache, kinds)
    rope = _rotary(inner, hidden, positions, kinds)
    for i in range(start, stop):
        hidden = inner.layers[i](
            hidden, attention_mask=masks.get(i, masks[types[i]]), position_embeddings=rope[types[i]],
            position_ids=positions, cache=cache, use_cache=True,
        )
    return hidden


@contextmanager
def inject_kv(cache: Any, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Any]:
    """While active, `cache.update(k, v, layer)` for a layer in `kv` stores (and returns for
    attention) the given rotated keys / values `[B, H, T, D]` instead of the computed ones."""
    original = cache.update

    def update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        if layer_idx in kv:
            k, v = kv[layer_idx]
            if k.shape != key_states.shape or v.shape != value_states.shape:
                raise ValueError(
                    f"layer {layer_idx}: injected K/V {tuple(k.shape)}/{tuple(v.shape)} do not match the computed "
                    f"{tuple(key_states.shape)}/{tuple(value_states.shape)}"
                )
            key_states, value_states = k.to(key_states.dtype), v.to(value_states.dtype)
        return original(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = update
    try:
        yield cache
    finally:
        del cache.update  # back to the class method
