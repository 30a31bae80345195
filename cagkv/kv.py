"""KVBlock: one chunk's canonical KV cache, plus its (de)serialisation and int8 quantisation.

A block holds the keys and values of every layer for the chunk's own tokens, the token
ids, the character span of each token in the chunk text, the text itself and the
fingerprint of the model that produced it. Keys are stored *position-free* (RoPE
undone), so a block can be placed anywhere in an assembled context.

Bytes are safetensors (never pickle): tensors plus one metadata entry `cagkv` holding a
sorted JSON object with the format name and version, dtype, fingerprint, text,
quantisation and `extra`. The same block always serialises to the same bytes, so a
content checksum identifies a block.

Example:
    >>> block = KVBlock(keys, values, token_ids, offsets, text, model_fingerprint="ab12")
    >>> raw = block.to_bytes(quantize="int8")
    >>> KVBlock.from_bytes(raw).num_tokens == block.num_tokens
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from cagkv.errors import CorruptBlobError

FORMAT = "cagkv.kvblock"
FORMAT_VERSION = 1
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
QUANTIZE_MODES = (None, "int8")
_META_KEY = "cagkv"
_INT8_MAX = 127.0


class KVFormatError(CorruptBlobError):
    """Bytes that are not a valid cagkv KV block (wrong format, shapes, NaN/Inf)."""


@dataclass
class KVBlock:
    """One chunk's cache.

    Args:
        keys: `[L, H, T, D]` keys, position-free when `positions_free` (RoPE undone).
        values: `[L, H, T, D]` values.
        token_ids: `[T]` int64 token ids of the chunk.
        offsets: `[T, 2]` int64 `(start, end)` character spans of each token in `text`.
        text: the chunk text.
        model_fingerprint: fingerprint of the model that produced the block.
        positions_free: False for models with learned positions (keys keep them).
        extra: free string metadata (tokenizer hash, chunking parameters, ...).
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor
    offsets: torch.Tensor
    text: str
    model_fingerprint: str
    positions_free: bool = True
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- properties
    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value tensors (the figure to compare with L*2*H*D*T*dtype)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise KVFormatError when shapes, dtypes or spans are inconsistent."""
        k, v = self.keys, self.values
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise KVFormatError("keys and values must be tensors")
        if k.dim() != 4 or v.shape != k.shape:
            raise KVFormatError(
                f"keys and values must both be [L, H, T, D]; got keys {tuple(k.shape)}, values {tuple(v.shape)}"
            )
        if k.dtype not in DTYPES.values() or v.dtype != k.dtype:
            raise KVFormatError(
                f"keys/values dtype must be one of {sorted(DTYPES)} and equal; got {k.dtype}, {v.dtype}"
            )
        t = k.shape[2]
        if self.token_ids.dim() != 1 or self.token_ids.shape[0] != t:
            raise KVFormatError(f"token_ids must be [T={t}]; got {tuple(self.token_ids.shape)}")
        if self.offsets.dim() != 2 or tuple(self.offsets.shape) != (t, 2):
            raise KVFormatError(f"offsets must be [T={t}, 2]; got {tuple(self.offsets.shape)}")
        if self.token_ids.dtype != torch.int64 or self.offsets.dtype != torch.int64:
            raise KVFormatError("token_ids and offsets must be int64")
        if not isinstance(self.text, str) or not isinstance(self.model_fingerprint, str):
            raise KVFormatError("text and model_fingerprint must be strings")
        if t and (
            bool((self.offsets < 0).any())
            or bool((self.offsets[:, 1] < self.offsets[:, 0]).any())
            or int(self.offsets.max()) > len(self.text)
        ):
            raise KVFormatError(f"offsets must be spans within the text (0..{len(self.text)})")

    def check_finite(self) -> None:
        """Raise KVFormatError when keys or values hold NaN or Inf."""
        for name, x in (("keys", self.keys), ("values", self.values)):
            if not bool(torch.isfinite(x).all()):
                raise KVFormatError(f"stored {name} hold NaN or Inf")

    # ---------------------------------------------------------------- bytes
    def to_bytes(self, quantize: str | None = None) -> bytes:
        """Serialise to safetensors bytes; `quantize="int8"` stores per-channel int8 + scales.

        int8 is symmetric, one float32 scale per (layer, head, channel) taken over the
        tokens; dequantisation restores the original dtype.
        """
        from safetensors.torch import save

        if quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
        self.check_finite()
        tensors: dict[str, torch.Tensor] = {
            "token_ids": self.token_ids,
            "offsets": self.offsets,
        }
        if quantize == "int8":
            for name, x in (("keys", self.keys), ("values", self.values)):
                q, scale = quantize_int8(x)
                tensors[name] = q
                tensors[name + "_scale"] = scale
        else:
            tensors["keys"] = self.keys
            tensors["values"] = self.values
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        header = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": _dtype_name(self.keys.dtype),
            "model_fingerprint": self.model_fingerprint,
            "text": self.text,
            "positions_free": "1" if self.positions_free else "0",
            "quantize": quantize or "none",
            "extra": self.extra,
        }
        # one metadata key holding sorted JSON: safetensors does not fix the order of several keys
        metadata = {_META_KEY: json.dumps(header, sort_keys=True, ensure_ascii=False, separators=(",", ":"))}
        return save(tensors, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVBlock:
        """Parse bytes written by `to_bytes`; refuses unknown formats, bad shapes, NaN/Inf."""
        from safetensors.torch import load

        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise KVFormatError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        meta = _read_metadata(data)
        if meta.get("format") != FORMAT:
            raise KVFormatError(f"not a cagkv KV block (format {meta.get('format')!r}, expected {FORMAT!r})")
        if meta.get("version") != FORMAT_VERSION:
            raise KVFormatError(
                f"unsupported KV block version {meta.get('version')!r} (this cagkv reads {FORMAT_VERSION})"
            )
        dtype_name = meta.get("dtype", "")
        if dtype_name not in DTYPES:
            raise KVFormatError(f"KV block dtype must be one of {sorted(DTYPES)}, got {dtype_name!r}")
        dtype = DTYPES[dtype_name]
        quant = meta.get("quantize")
        if quant not in ("none", "int8"):
            raise KVFormatError(f"unknown quantisation {quant!r} (expected none or int8)")
        try:
            tensors = load(data)
        except Exception as e:  # safetensors raises its own error types on malformed data
            raise KVFormatError(f"unreadable KV block tensors: {e}") from None
        needed = {"token_ids", "offsets", "keys", "values"}
        if quant == "int8":
            needed |= {"keys_scale", "values_scale"}
        if set(tensors) != needed:
            raise KVFormatError(f"KV block tensors must be {sorted(needed)}, got {sorted(tensors)}")
        if quant == "int8":
            keys = dequantize_int8(tensors["keys"], tensors["keys_scale"], dtype)
            values = dequantize_int8(tensors["values"], tensors["values_scale"], dtype)
        else:
            keys, values = tensors["keys"], tensors["values"]
            if keys.dtype != dtype or values.dtype != dtype:
                raise KVFormatError(f"KV block tensors are {keys.dtype}/{values.dtype}, header says {dtype_name}")
        extra = meta.get("extra", {})
        if not isinstance(extra, dict) or not all(isinstance(x, str) for x in extra.values()):
            raise KVFormatError("KV block 'extra' metadata must be a JSON object of strings")
        block = cls(
            keys=keys,
            values=values,
            token_ids=tensors["token_ids"],
            offsets=tensors["offsets"],
            text=meta.get("text"),
            model_fingerprint=meta.get("model_fingerprint"),
            positions_free=meta.get("positions_free") == "1",
            extra=extra,
        )
        block.check_finite()
        return block


# -------------------------------------------------------------------- int8 helpers
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: x [L, H, T, D] -> (q int8 [L, H, T, D], scale f32 [L, H, 1, D])."""
    assert x.dim() == 4, f"expected [L, H, T, D], got {tuple(x.shape)}"
    xf = x.detach().to(torch.float32)
    if xf.shape[2] == 0:
        return xf.to(torch.int8), torch.ones(xf.shape[0], xf.shape[1], 1, xf.shape[3])
    amax = xf.abs().amax(dim=2, keepdim=True)  # [L, H, 1, D]: one scale per channel over tokens
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_int8`, checking the shapes of untrusted input."""
    if q.dtype != torch.int8 or scale.dtype != torch.float32 or q.dim() != 4:
        raise KVFormatError(f"int8 block must hold int8 [L,H,T,D] and float32 scales; got {q.dtype}, {scale.dtype}")
    l, h, _, d = q.shape
    if tuple(scale.shape) != (l, h, 1, d):
        raise KVFormatError(f"int8 scale must be [{l}, {h}, 1, {d}], got {tuple(scale.shape)}")
    if not bool(torch.isfinite(scale).all()):
        raise KVFormatError("int8 scales hold NaN or Inf")
    return (q.to(torch.float32) * scale).to(dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise KVFormatError(f"KV dtype must be one of {sorted(DTYPES)}, got {dtype}")


def _read_metadata(data: bytes) -> dict[str, Any]:
    """The cagkv header (JSON in the safetensors `__metadata__`), checked before any tensor is read."""
    if len(data) < 8:
        raise KVFormatError("KV block is truncated (no safetensors header)")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data) or n > 100_000_000:
        raise KVFormatError("KV block is truncated or has an invalid header length")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise KVFormatError("KV block header is not valid JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise KVFormatError("KV block header lacks string metadata")
    if _META_KEY not in meta:
        raise KVFormatError("not a cagkv KV block (no cagkv header)")
    try:
        ours = json.loads(meta[_META_KEY])
    except json.JSONDecodeError:
        raise KVFormatError("KV block cagkv header is not JSON") from None
    if not isinstance(ours, dict):
        raise KVFormatError("KV block cagkv header is not a JSON object")
    return ours
