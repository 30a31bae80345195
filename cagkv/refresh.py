"""Question-time refresh: the target recomputes the part of a translated cache its question reads.

A translated cache is cheap but imperfect; native prefill is exact but costs the whole
chunk. `refresh` spends a fraction of the prefill on the tokens that matter for *this*
question: the question is run once over the translated cache, the chunk tokens it attends to
most (attention mass summed over layers, heads and question tokens; by default relative to
what a neutral prompt attends to, `contrast`) are chosen, and the target recomputes those
tokens through every layer, each attending to the cache before it (translated entries of
the rest, fresh entries of the refreshed tokens). Their keys and values then replace the
translated ones in place. The cost is one (batched) pass of the prompts plus `fraction` of
the chunk's tokens through the target (docs/EXPERIMENTS.md E39-E43).

Example:
    >>> q, neutral = prompt_attention(target.model, cache, n, [prompt_ids, neutral_ids])  # doctest: +SKIP
    >>> mass = contrast(q, neutral, candidates)                                 # doctest: +SKIP
    >>> chosen = top_positions(mass, candidates, fraction=1 / 3)               # doctest: +SKIP
    >>> refresh_tokens(target.model, cache, [token_of[p] for p in chosen], chosen)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from cagkv.models.cache import full_copy, layer_span
from cagkv.models.layers import (AttentionBias, decoder_of, eager_attention, forward_at, head_logits, layer_types,
                                 run_layers)

__all__ = ["SCORINGS", "NEEDS_DIFFICULTY", "DEFAULT_SCORING", "PEAK_Z", "POOL_WIDTH", "DRAFT_TOKENS", "prompt_attention", "question_attention",
           "contrast", "pool", "union_rank", "peakedness", "draft_answer", "score_positions", "top_positions", "refresh_tokens", "shift_translated", "feed"]

# how refresh ranks chunk tokens: "attention", the mass the question gives them; "contrast", that
# mass over the mass a question-agnostic prompt gives them (docs/EXPERIMENTS.md E43); "pooled",
# contrast averaged over POOL_WIDTH neighbours, so spans rather than lone tokens are chosen (E44);
# "averaged", contrast against the mean mass of several neutral prompts rather than one (E49);
# "drafted", contrast of the question followed by the first answer tokens it gets from the
# translated cache, which read where the answer is rather than where the question's words are (E58);
# "difficulty", the translator's expected error for each token id (cagkv.translate.difficulty: no
# question pass at all), and "contrast_difficulty", contrast times that expected error (E69);
# "union", each token's better rank of the two, contrast and contrast_difficulty, so a share
# takes the top of both lists (the product alone outvotes the few tokens a long haystack's
# question needs: E69's needles; E71); "adaptive", contrast where the question's contrast has an
# outlier far above a flat body (a lookup: `peakedness` >= PEAK_Z), contrast_difficulty elsewhere (E72)
SCORINGS = ("attention", "contrast", "pooled", "averaged", "drafted", "difficulty", "contrast_difficulty", "union",
            "adaptive")
NEEDS_DIFFICULTY = ("difficulty", "contrast_difficulty", "union", "adaptive")
DEFAULT_SCORING = "contrast"  # measured: E43
# "adaptive"'s switch where a translator's card names none (`Translator.peak_z`), chosen for the
# reverse pair on held-out SQuAD (z <= 38.3) and needles (z >= 46.1): E72
PEAK_Z = 42.0
POOL_WIDTH = 5  # SnapKV's default pooling kernel
DRAFT_TOKENS = 8  # the drafted answer's length for "drafted"
# `shift_translated` leaves a block as it is when fewer of its tokens were refreshed than this:
# the mean change of a handful of tokens is mostly their own noise
MIN_SHIFT_TOKENS = 8


@torch.inference_mode()
def prompt_attention(model: nn.Module, cache: Any, n: int, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Attention mass `[len(prompts), n]` that each prompt, placed after the `n` cached tokens,
    gives each cached position: one batched pass of the decoder.

    Prompts are right-padded to the longest; a pad comes after every real token, so causal
    attention keeps it out of their rows, and its own rows are left out. `cache` is not
    changed (the pass runs on a copy). Uses eager attention for this one pass (the only
    implementation that returns the weights) and restores the model's own after.
    """
    prompts = [list(p) for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("no prompt tokens to measure attention from")
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    device = next(model.parameters()).device
    ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts], device=device)
    work = copy.deepcopy(cache)
    if len(prompts) > 1:
        work.batch_repeat_interleave(len(prompts))
    positions = (n + torch.arange(width, device=device)).unsqueeze(0).expand(len(prompts), -1)
    with eager_attention(model):
        # the decoder only: the LM head (a 262k vocabulary on Gemma-3) would double this pass's time
        out = decoder_of(model)(input_ids=ids, cache=work, position_ids=positions, use_cache=True,
                                output_attentions=True)
    mass = torch.zeros(len(prompts), n, device=device)
    for weights in out.attentions:  # [P, H, Q, K]: K = what the layer holds (a sliding layer may hold fewer) + Q
        held_count = weights.shape[-1] - width
        for row, length in enumerate(lengths):
            mass[row, n - held_count:] += weights[row, :, :length, :held_count].float().sum(dim=(0, 1))
    return mass.cpu()  # ranking is host-side bookkeeping


def question_attention(model: nn.Module, cache: Any, n: int, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Attention mass `[n]` that `prompt_ids`, placed after the `n` cached tokens, give each cached position."""
    return prompt_attention(model, cache, n, [prompt_ids])[0]


def contrast(mass: torch.Tensor, baseline: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    """`(mass + c) / (baseline + c)`: how much more the question reads each position than a
    prompt that asks nothing in particular (`c`, the baseline's mean over `candidates`, keeps
    positions that neither reads from ranking high on noise).

    Summed attention favours the positions every prompt reads (sentence ends, line breaks,
    the first tokens of a chunk: attention sinks); the ratio keeps what this question reads.
    """
    c = baseline[torch.as_tensor(list(candidates), dtype=torch.long)].mean() if candidates else baseline.new_tensor(0.0)
    return (mass + c) / (baseline + c)


def pool(score: torch.Tensor, candidates: Sequence[int], width: int = POOL_WIDTH) -> torch.Tensor:
    """`score` at each candidate averaged over the `width` candidates centred on it (fewer at
    the ends of a run of consecutive positions; runs do not mix). Other positions keep theirs.

    A token the question reads is rarely the whole of what it needs (the answer sits beside
    the words that match the question): smoothing lets the neighbours of a peak rank with it.
    """
    if width < 1 or width % 2 == 0:
        raise ValueError(f"pool width must be odd and positive, got {width}")
    out = score.clone()
    if not candidates:
        return out
    index = torch.as_tensor(sorted(candidates), dtype=torch.long)
    breaks = (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()
    for run in torch.tensor_split(index, breaks):
        values = score[run].float()[None, None]
        out[run] = torch.nn.functional.avg_pool1d(values, width, stride=1, padding=width // 2,
                                                  count_include_pad=False)[0, 0].to(score.dtype)
    return out


@torch.inference_mode()
def draft_answer(model: nn.Module, cache: Any, n: int, prompt_ids: Sequence[int], count: int = DRAFT_TOKENS,
                 stop_ids: Sequence[int] = ()) -> list[int]:
    """The greedy continuation of `prompt_ids` placed after the `n` cached tokens: at most
    `count` ids, ending before the first of `stop_ids`. `cache` is not changed (a copy decodes)."""
    work = copy.deepcopy(cache)
    ids, position, drafted = list(prompt_ids), n, []
    stops = set(stop_ids)
    for _ in range(count):
        logits = forward_at(model, ids, position, work).logits[0, -1]
        position += len(ids)
        token = int(torch.argmax(logits))
        if token in stops:
            break
        drafted.append(token)
        ids = [token]
    return drafted


def score_positions(model: nn.Module, cache: Any, n: int, prompt_ids: Sequence[int],
                    neutral_ids: Sequence[Sequence[int]], candidates: Sequence[int],
                    scoring: str = DEFAULT_SCORING, draft_ids: Sequence[int] = (),
                    difficulty: torch.Tensor | None = None, peak_z: float = PEAK_Z) -> torch.Tensor:
    """How much `prompt_ids` need each cached position `[n]`, by `scoring` (one of SCORINGS):
    all prompts in one batched pass. `neutral_ids` are question-agnostic prompts in the same
    template; "contrast", "pooled" and "drafted" use the first, "averaged" all of them.
    "drafted" measures `prompt_ids + draft_ids` (`draft_answer`), its mass scaled to the
    question's length so that the contrast's offset weighs as it does for the question alone.
    The scorings of NEEDS_DIFFICULTY need `difficulty` `[n]`, the expected translation
    error at each position (`cagkv.translate.difficulty`); "adaptive" switches to contrast
    at a `peakedness` of `peak_z` (the translator's own threshold where its card names one)."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}: expected one of {', '.join(SCORINGS)}")
    if scoring in NEEDS_DIFFICULTY:
        if difficulty is None or difficulty.shape != (n,):
            raise ValueError(f"scoring {scoring!r} needs the expected error of each of the {n} positions")
        if scoring == "difficulty":
            return difficulty.float().cpu()
        question = score_positions(model, cache, n, prompt_ids, neutral_ids, candidates)
        if scoring == "adaptive" and peakedness(question, candidates) >= peak_z:
            return question
        product = question * difficulty.float().cpu()
        return union_rank(question, product, candidates) if scoring == "union" else product
    if scoring == "attention":
        return prompt_attention(model, cache, n, [prompt_ids])[0]
    neutral = list(neutral_ids) if scoring == "averaged" else list(neutral_ids)[:1]
    if not neutral:
        raise ValueError(f"scoring {scoring!r} needs a neutral prompt")
    asked = [*prompt_ids, *draft_ids] if scoring == "drafted" else list(prompt_ids)
    masses = prompt_attention(model, cache, n, [asked, *neutral])
    mass = contrast(masses[0] * (len(prompt_ids) / len(asked)), masses[1:].mean(dim=0), candidates)
    return pool(mass, candidates) if scoring == "pooled" else mass


def union_rank(first: torch.Tensor, second: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    """Each candidate's better quantile in the two scores (1.0 = first of either list; other
    positions 0): the top share by it is the union of both lists' tops, each cut at the same depth."""
    out = torch.zeros_like(first, dtype=torch.float32)
    if not candidates:
        return out
    index = torch.as_tensor(list(candidates), dtype=torch.long)
    count = len(index)

    def quantile(score: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(score[index].float(), descending=True, stable=True)
        q = torch.empty(count, dtype=torch.float32)
        q[order] = 1.0 - torch.arange(count, dtype=torch.float32) / count
        return q

    # ties between the lists go to the first: its quantile is nudged up by less than a rank
    out[index] = torch.maximum(quantile(first) + 0.5 / count, quantile(second))
    return out


def peakedness(score: torch.Tensor, candidates: Sequence[int]) -> float:
    """How far the best candidate's score stands above the rest: `(max - median) / MAD` over
    `candidates`, each median the lower middle value as torch takes it (0.0 for fewer than two,
    or when the body is exactly flat and nothing stands out; inf when only the best stands out)

    A question that names one passage of a long, unrelated text (a needle) reads it far above
    a flat body (E72: 46-90 on the needles); a question over a short passage that it is all
    about reads broadly (SQuAD: 38 at most).
    """
    if len(candidates) < 2:
        return 0.0
    values = score[torch.as_tensor(list(candidates), dtype=torch.long)].double()
    median = values.median()
    spread = (values - median).abs().median()
    top = values.max() - median
    if spread == 0:
        return math.inf if top > 0 else 0.0
    return float(top / spread)


def top_positions(mass: torch.Tensor, candidates: Sequence[int], fraction: float) -> list[int]:
    """The `round(fraction * len(candidates))` candidate positions (at least one) with the most mass, sorted."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not candidates:
        return []
    index = torch.as_tensor(list(candidates), dtype=torch.long)
    count = max(1, round(fraction * len(index)))
    best = torch.topk(mass[index], count).indices
    return sorted(int(p) for p in index[best])


def token_ids_at(placed: Iterable[tuple[int, Any]]) -> dict[int, int]:
    """Absolute position -> token id over placed blocks (start position, KVBlock)."""
    token_at: dict[int, int] = {}
    for start, block in placed:
        token_at.update(zip(range(start, start + block.num_tokens), block.token_ids.tolist()))
    return token_at


def expected_error(difficulty: torch.Tensor, token_at: dict[int, int], positions: Sequence[int], size: int,
                   fill: float = 0.0) -> torch.Tensor:
    """`[size]`: the difficulty table's (`[V]`) expected translation error of the token at each of
    `positions` (ids past the table read its last entry), `fill` everywhere else."""
    out = torch.full((size,), fill)
    if positions:
        ids = torch.tensor([token_at[p] for p in positions], dtype=torch.long)
        out[torch.as_tensor(list(positions), dtype=torch.long)] = difficulty[ids.clamp_max(len(difficulty) - 1)].float().cpu()
    return out


def hardest_positions(difficulty: torch.Tensor, placed: Iterable[tuple[int, Any]], positions: Sequence[int],
                      fraction: float) -> list[int]:
    """The `fraction` of `positions` (absolute, inside the placed blocks: (start, KVBlock)) whose
    token ids the translator's difficulty table `[V]` ranks hardest (its expected error), sorted."""
    if not positions:
        return []
    mass = expected_error(difficulty, token_ids_at(placed), positions, max(positions) + 1, fill=float("-inf"))
    return top_positions(mass, positions, fraction)


def _mask(key_positions: torch.Tensor, stale: torch.Tensor, query_positions: torch.Tensor,
          window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[1, 1, Q, K]`: a query sees keys at or before its position, not stale ones, within `window`."""
    allowed = (key_positions[None, :] <= query_positions[:, None]) & ~stale[None, :]
    if window:
        allowed &= (query_positions[:, None] - key_positions[None, :]) < window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@torch.inference_mode()
def refresh_tokens(model: nn.Module, cache: Any, token_ids: Sequence[int], positions: Sequence[int]) -> None:
    """Recompute `token_ids` at `positions` (sorted, all already in `cache`) through every layer, in place.

    Each token attends causally to the cache's entries before it, except the stale entries at
    `positions`, and to the recomputed tokens at or before it; then its keys and values
    replace the stale ones on every layer. Every layer must hold what the tokens attend to
    (a sliding layer trimmed past a token's window is refused).
    """
    if len(token_ids) != len(positions):
        raise ValueError(f"{len(token_ids)} tokens for {len(positions)} positions")
    if not positions:
        return
    work, spans, _ = _recompute(model, cache, token_ids, positions, [])
    count = len(positions)
    for (first, total), layer, fresh in zip(spans, cache.layers, work.layers):
        local = torch.as_tensor(list(positions), dtype=torch.long, device=layer.keys.device) - first  # every position is held: checked
        layer.keys[:, :, local] = fresh.keys[:, :, total - first : total - first + count]
        layer.values[:, :, local] = fresh.values[:, :, total - first : total - first + count]


@torch.inference_mode()
def shift_translated(cache: Any, ropes: Sequence[Any], blocks: Sequence[tuple[int, int]], positions: Sequence[int],
                     stale: Sequence[tuple[torch.Tensor, torch.Tensor]], min_tokens: int | None = None) -> None:
    """Move each block's tokens that `refresh_tokens` left translated by the block's mean change
    of its refreshed ones, per layer and head, in place. Measured harmful: -6.7 points of
    answer log-prob recovery at a third on SmolLM2 -> Gemma-3 (docs/EXPERIMENTS.md E84), so
    refresh does not shift unless asked (`CAG.prepare(refresh_shift=True)`).

    A translated chunk's error is partly one offset shared by all its tokens (of a layer, a
    head); the refreshed tokens measure it: for them the cache now holds the target's own
    keys and values, `stale` the translated ones they replaced (per layer: keys, values
    `[B, H, len(positions), D]`, keys with RoPE). Keys are compared and moved before RoPE
    (`ropes`, one per layer). `blocks`: (first position, token count) of each translated
    block; separators and the prefix between them are left alone, and so is a block with
    fewer than `min_tokens` refreshed tokens (default `MIN_SHIFT_TOKENS`).
    """
    from cagkv.models.rope import rotate, unrotate

    chosen = torch.as_tensor(list(positions), dtype=torch.long)
    spans = [layer_span(cache, i) for i in range(len(cache.layers))]
    for start, count in blocks:
        inside = (chosen >= start) & (chosen < start + count)
        if int(inside.sum()) < max(1, MIN_SHIFT_TOKENS if min_tokens is None else min_tokens):
            continue
        fresh_at = chosen[inside]
        rest = torch.ones(count, dtype=torch.bool)
        rest[fresh_at - start] = False
        rest_at = torch.nonzero(rest).flatten() + start
        if not len(rest_at):
            continue
        for (first, _), layer, rope, (old_k, old_v) in zip(spans, cache.layers, ropes, stale):
            keys, values = layer.keys, layer.values
            src, dst = (fresh_at - first).to(keys.device), (rest_at - first).to(keys.device)
            old_k, old_v = old_k[:, :, inside.to(old_k.device)].float(), old_v[:, :, inside.to(old_v.device)].float()
            dk = unrotate(keys[:, :, src].float() - old_k, fresh_at.to(keys.device), rope).mean(dim=2, keepdim=True)
            dv = (values[:, :, src].float() - old_v).mean(dim=2, keepdim=True)
            shape = (*dk.shape[:2], len(rest_at), dk.shape[-1])
            keys[:, :, dst] = (keys[:, :, dst].float() + rotate(dk.expand(shape), rest_at.to(keys.device), rope)).to(keys.dtype)
            values[:, :, dst] = (values[:, :, dst].float() + dv.expand(shape)).to(values.dtype)


@torch.inference_mode()
def feed(model: nn.Module, cache: Any, n: int, ids: Sequence[int], stale: dict[int, int] | None = None,
         keep: int = 1, bias: AttentionBias | None = None) -> tuple[Any, torch.Tensor]:
    """Feed `ids` at positions `n..` after the `n` cached tokens; returns (the cache holding
    `n + len(ids)` tokens, the logits `[keep, V]` of the last `keep` ids; all of them when 0).

    `stale` (position -> token id, positions inside the cache) names entries whose keys and
    values are placeholders or approximations: they are recomputed in the *same* forward as
    `ids` (as `refresh_tokens` would, before), and `ids` attend to the recomputed entries.
    One forward instead of two is one read of the weights instead of two, which is most of
    the cost of a few tokens on a CPU. Without `stale` this is the model's own forward (which
    extends `cache` in place); with it `cache` is left as it was and the returned cache holds
    every token on every layer, in the layout the model builds for itself.
    `bias` (`cagkv.models.layers.AttentionBias`) applies to the attention of `ids`, not to the
    recomputed entries', which are computed as `refresh_tokens` computes them.
    """
    ids = list(ids)
    if not ids:
        raise ValueError("no tokens to feed")
    if not stale:
        out = forward_at(model, ids, n, cache, keep, bias=bias)
        return out.cache, out.logits[0]
    from cagkv.models.cache import full_cache, model_layout

    order = sorted(stale)
    work, spans, hidden = _recompute(model, cache, [stale[p] for p in order], order, ids, n, bias)
    count = len(order)
    merged = full_cache()
    local = torch.as_tensor(order, dtype=torch.long, device=hidden.device)
    for i, ((first, total), fresh) in enumerate(zip(spans, work.layers)):
        held = total - first
        keys, values = fresh.keys, fresh.values  # new tensors (held + recomputed + fed): `cache` is not touched
        keys[:, :, local - first] = keys[:, :, held : held + count].clone()
        values[:, :, local - first] = values[:, :, held : held + count].clone()
        merged.update(torch.cat([keys[:, :, :held], keys[:, :, held + count :]], dim=2),
                      torch.cat([values[:, :, :held], values[:, :, held + count :]], dim=2), i)
    tail = hidden[:, count:] if keep == 0 else hidden[:, -keep:]
    return model_layout(decoder_of(model).config, merged), head_logits(model, tail)[0]


def _recompute(model: nn.Module, cache: Any, token_ids: Sequence[int], positions: Sequence[int],
               appended: Sequence[int], n: int | None = None,
               bias: AttentionBias | None = None) -> tuple[Any, list[tuple[int, int]], torch.Tensor]:
    """One pass of `token_ids` at `positions` (inside `cache`) followed by `appended` at `n..`:
    returns (a `full_copy` of the cache with their entries after the held ones, each layer's
    (first, total) span held, the residual stream after the last layer `[1, T, E]`). `bias`
    applies to the rows of `appended` only."""
    if len(token_ids) != len(positions):
        raise ValueError(f"{len(token_ids)} tokens for {len(positions)} positions")
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    if bool((pos[1:] <= pos[:-1]).any()):
        raise ValueError("positions must be strictly increasing")
    inner = decoder_of(model)
    n_layers = len(inner.layers)
    if len(cache.layers) != n_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, the model {n_layers}")
    types = layer_types(inner.config, n_layers)
    window = getattr(inner.config, "sliding_window", None)
    spans = []
    for i, layer in enumerate(cache.layers):
        first, total = layer_span(cache, i)
        if len(pos) and int(pos[-1]) >= total:
            raise ValueError(f"position {int(pos[-1])} is not in the cache (layer {i} holds [{first}, {total}))")
        if appended and total != n:
            raise ValueError(f"feeding at position {n}, but layer {i} holds {total} tokens")
        reach = max(0, int(pos[0]) - window + 1) if window and types[i] == "sliding_attention" else 0
        if first > reach:  # a trimmed sliding layer: what the token attended to is gone
            raise ValueError(
                f"layer {i} holds tokens [{first}, {total}) only; recomputing position {int(pos[0])} needs them "
                f"from {reach}: assemble the cache with full_cache() to refresh it"
            )
        spans.append((first, total))
    work = full_copy(cache)  # never trims, so the fresh entries are the last len(queries) of every layer
    dtype, device = cache.layers[0].keys.dtype, cache.layers[0].keys.device
    pos = pos.to(device)  # the masks are [Q, K]: built where they are used (a long refresh makes them large)
    queries = torch.cat([pos, (n or 0) + torch.arange(len(appended), device=device)])
    masks: dict[str | int, torch.Tensor] = {}
    for kind in set(types):
        first, total = spans[types.index(kind)]
        held = torch.arange(first, total, device=device)
        key_positions = torch.cat([held, queries])
        stale = torch.cat([torch.isin(held, pos), torch.zeros(len(queries), dtype=torch.bool, device=device)])
        masks[kind] = _mask(key_positions, stale, queries, window if kind == "sliding_attention" else None, dtype)
        if bias is not None and bias.acts_in(kind) and appended:
            extra = torch.zeros_like(masks[kind])
            extra[..., len(pos):, :] = bias.matrix(queries[len(pos):], key_positions, kind).to(dtype)
            masks.update(bias.add_to(masks[kind], extra, kind, types))
    hidden = model.get_input_embeddings()(torch.tensor([[*token_ids, *appended]], device=device))
    hidden = run_layers(model, hidden.to(dtype), queries[None], work, 0, masks=masks)
    return work, spans, hidden
