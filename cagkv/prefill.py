"""Canonical prefill: chunk texts -> position-free KV blocks, in batches.

Each chunk is prefilled after the model's own context prefix (BOS / chat header /
"Context:\n": the attention sink every chunk sees at answer time too), followed by the
prompt's chunk separator ("\n\n"). Only the chunk's and its separator's positions are
kept, with RoPE undone, so blocks concatenate into exactly the token sequence a native
prefill of prefix + chunk + separator + chunk + separator ... sees, and assembling them
needs no forward pass. The separator tokens are the block's last
`extra["separator_tokens"]` tokens; their character spans are empty at the end of the
text (`(len(text), len(text))`), since `block.text` is the chunk text alone.

Batches are right-padded: under causal attention the padding at the end never
influences a real token, so no attention mask is needed and every row keeps positions
0..P+T-1.

Example:
    >>> loaded = load("smollm2-135m")
    >>> blocks = prefill_chunks(loaded, ["Paris is the capital of France."], batch_size=8)
    >>> blocks[0].keys.shape          # [L, H, T, D]: 7 chunk tokens + 1 separator
    torch.Size([30, 3, 8, 64])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cagkv.kv import KVBlock
from cagkv.models.cache import full_cache
from cagkv.models.rope import unrotate_layers
from cagkv.prompt import PromptFormat

if TYPE_CHECKING:
    from cagkv.models import LoadedModel


def prefill_chunks(
    loaded: LoadedModel,
    texts: Sequence[str],
    batch_size: int = 8,
    fmt: PromptFormat | None = None,
) -> list[KVBlock]:
    """Prefill each chunk after the context prefix; one position-free KVBlock per text.

    Args:
        loaded: the canonical model (its dtype is the blocks' dtype).
        texts: chunk texts; each block's text is the chunk text itself, its tokens
            the chunk's followed by the separator's.
        batch_size: chunks per forward pass (sorted by length to limit padding).
        fmt: the model's prompt format (computed from `loaded` when None).
    Returns:
        blocks in the order of `texts`, keys and values `[L, H, T, D]`.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    fmt = fmt or PromptFormat.for_model(loaded)
    prefix = fmt.context_prefix_ids()
    sep = fmt.separator_ids()
    n_sep = len(sep)
    encoded = [_encode_with_offsets(fmt, t, sep) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: -len(encoded[i][0]))  # longest first
    blocks: list[KVBlock | None] = [None] * len(texts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        keys, values = _prefill_batch(loaded, prefix, [encoded[i][0] for i in rows])
        for row, i in enumerate(rows):
            ids, offsets, block_text = encoded[i]
            t = len(ids)
            blocks[i] = KVBlock(
                keys=keys[row][:, :, :t].contiguous(),  # [L, H, T, D], on the model's device
                values=values[row][:, :, :t].contiguous(),
                token_ids=torch.tensor(ids, dtype=torch.long),
                offsets=torch.tensor(offsets, dtype=torch.long).reshape(t, 2),  # [T, 2]
                text=block_text,
                model_fingerprint=loaded.fingerprint,
                positions_free=not loaded.spec.learned_positions,
                extra={
                    "prefix_tokens": str(len(prefix)),
                    "separator": fmt.chunk_separator,
                    "separator_tokens": str(n_sep),
                },
            )
    return [b for b in blocks if b is not None]


def _encode_with_offsets(
    fmt: PromptFormat, text: str, sep: list[int]
) -> tuple[list[int], list[tuple[int, int]], str]:
    """Token ids and character spans of one chunk as placed in the prompt, separator included."""
    enc = fmt.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not ids:
        raise ValueError(f"chunk tokenizes to nothing: {text[:40]!r}")
    assert ids == fmt.chunk_ids(text), "tokenizer gives different ids with offsets"
    n = len(text)
    offsets = [(min(max(0, a), n), min(max(a, b), n)) for a, b in enc["offset_mapping"]]
    offsets += [(n, n)] * len(sep)  # the separator lies after the text: empty spans at its end
    return ids + sep, offsets, text


@torch.inference_mode()
def _prefill_batch(
    loaded: LoadedModel, prefix: list[int], chunks: list[list[int]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward prefix + chunk for each row; returns per-row keys/values `[L, H, Tmax, D]`."""
    p, tmax = len(prefix), max(len(c) for c in chunks)
    pad = _pad_id(loaded)
    ids = torch.tensor([prefix + c + [pad] * (tmax - len(c)) for c in chunks], device=loaded.device)  # [B, P+Tmax]
    # full_cache(): sliding-window layers keep every token too, so long chunks survive
    out = loaded.model(input_ids=ids, cache=full_cache(), use_cache=True, logits_to_keep=1)
    spec = loaded.spec
    layers = out.cache.layers
    assert all(layer.keys.shape[2] == p + tmax for layer in layers), "a layer dropped tokens"
    keys = torch.stack([layer.keys for layer in layers])[:, :, :, p:]  # [L, B, H, Tmax, D]
    values = torch.stack([layer.values for layer in layers])[:, :, :, p:]
    positions = torch.arange(p, p + tmax, dtype=torch.long, device=ids.device)  # [Tmax]
    dtype = keys.dtype
    if not spec.learned_positions:
        keys = unrotate_layers(keys, positions, spec.rope, out_dtype=torch.float32).to(dtype)  # fp32 math
    keys = keys.transpose(0, 1)  # [B, L, H, Tmax, D]
    values = values.transpose(0, 1)
    return list(keys), list(values)


def _pad_id(loaded: LoadedModel) -> int:
    tok = loaded.tokenizer
    for candidate in (tok.pad_token_id, tok.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0
