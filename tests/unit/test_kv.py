"""KVBlock: round trips, determinism, int8 quantisation, refusal of bad bytes."""

from __future__ import annotations

import json

import pytest
import torch

from cagkv.errors import CorruptBlobError
from cagkv.kv import KVBlock, KVFormatError, dequantize_int8, quantize_int8


def make_block(l: int = 3, h: int = 2, t: int = 5, d: int = 8, dtype=torch.float32, seed: int = 0) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    text = "héllo wörld ✓ " * t
    starts = torch.arange(t, dtype=torch.int64) * 2
    offsets = torch.stack([starts, starts + 2], dim=1)  # [T, 2]
    return KVBlock(
        keys=torch.randn(l, h, t, d, generator=g).to(dtype),
        values=torch.randn(l, h, t, d, generator=g).to(dtype),
        token_ids=torch.randint(0, 1000, (t,), generator=g),
        offsets=offsets,
        text=text,
        model_fingerprint="0123456789abcdef",
        extra={"tokenizer": "tk1", "chunk_tokens": "256"},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_exact(dtype):
    b = make_block(dtype=dtype)
    r = KVBlock.from_bytes(b.to_bytes())
    assert r.keys.dtype == dtype and r.values.dtype == dtype
    assert torch.equal(r.keys, b.keys) and torch.equal(r.values, b.values)
    assert torch.equal(r.token_ids, b.token_ids) and torch.equal(r.offsets, b.offsets)
    assert r.text == b.text and r.model_fingerprint == b.model_fingerprint
    assert r.extra == b.extra and r.positions_free
    assert r.num_tokens == 5 and r.nbytes == b.nbytes


def test_bytes_are_deterministic():
    assert make_block().to_bytes() == make_block().to_bytes()
    assert make_block().to_bytes("int8") == make_block().to_bytes("int8")
    assert make_block(seed=1).to_bytes() != make_block().to_bytes()


def test_stored_bytes_close_to_tensor_bytes():
    b = make_block(l=4, h=2, t=64, d=32, dtype=torch.bfloat16)
    raw = b.to_bytes()
    assert b.nbytes == 4 * 2 * 2 * 64 * 32 * 2
    # header + ids + offsets stay small next to the tensors
    assert len(raw) < b.nbytes * 1.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_error_small_and_size_halved(dtype):
    b = make_block(l=2, h=2, t=256, d=64, dtype=dtype)
    raw = b.to_bytes("int8")
    r = KVBlock.from_bytes(raw)
    assert r.keys.dtype == dtype
    err = (r.keys.float() - b.keys.float()).abs().max()
    step = b.keys.float().abs().amax(dim=2, keepdim=True) / 127  # one quantisation step per channel
    assert err <= step.max() * 0.51 + 1e-2
    if dtype == torch.bfloat16:
        assert len(raw) < len(b.to_bytes()) * 0.6


def test_int8_per_channel_scales_shape():
    x = torch.randn(3, 2, 7, 4)
    x[1, 0, :, 2] *= 100  # one loud channel must not crush the others
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (3, 2, 1, 4)
    back = dequantize_int8(q, s, torch.float32)
    assert (back - x)[0].abs().max() < 0.05
    # an all-zero channel survives
    z = torch.zeros(1, 1, 3, 2)
    qz, sz = quantize_int8(z)
    assert torch.equal(dequantize_int8(qz, sz, torch.float32), z)


def test_nan_and_inf_refused_on_write_and_read():
    b = make_block()
    b.keys[0, 0, 0, 0] = float("nan")
    with pytest.raises(KVFormatError, match="NaN or Inf"):
        b.to_bytes()
    # forge bytes with an Inf behind to_bytes' back
    from safetensors.torch import save

    good = make_block()
    raw = good.to_bytes()
    meta = _raw_meta(raw)
    vals = good.values.clone()
    vals[1, 1, 1, 1] = float("inf")
    forged = save({"keys": good.keys, "values": vals, "token_ids": good.token_ids, "offsets": good.offsets}, meta)
    with pytest.raises(CorruptBlobError, match="NaN or Inf"):
        KVBlock.from_bytes(forged)


def _raw_meta(raw: bytes) -> dict[str, str]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])["__metadata__"]


def _forge(meta_patch: dict | None = None, tensors_patch: dict | None = None) -> bytes:
    from safetensors.torch import save

    good = make_block()
    meta = _raw_meta(good.to_bytes())
    if meta_patch is not None:
        ours = json.loads(meta["cagkv"])
        ours.update(meta_patch)
        meta = {"cagkv": json.dumps(ours)}
    tensors = {"keys": good.keys, "values": good.values, "token_ids": good.token_ids, "offsets": good.offsets}
    tensors.update(tensors_patch or {})
    tensors = {k: v for k, v in tensors.items() if v is not None}
    return save(tensors, meta)


@pytest.mark.parametrize(
    "meta_patch,tensors_patch,match",
    [
        ({"format": "other"}, None, "not a cagkv KV block"),
        ({"version": 99}, None, "unsupported KV block version"),
        ({"text": 5}, None, "must be strings"),
        ({"dtype": "int4"}, None, "dtype must be one of"),
        ({"quantize": "fp4"}, None, "unknown quantisation"),
        (None, {"values": torch.zeros(3, 2, 4, 8)}, r"\[L, H, T, D\]"),
        (None, {"token_ids": torch.zeros(4, dtype=torch.int64)}, "token_ids"),
        (None, {"offsets": torch.zeros(5, 3, dtype=torch.int64)}, "offsets"),
        (None, {"offsets": torch.full((5, 2), 10_000, dtype=torch.int64)}, "spans within"),
        (None, {"extra_tensor": torch.zeros(1)}, "tensors must be"),
        (None, {"keys": None}, "tensors must be"),
        ({"extra": [1, 2]}, None, "JSON object of strings"),
        ({"dtype": "bfloat16"}, None, "header says"),
    ],
)
def test_forged_blocks_refused(meta_patch, tensors_patch, match):
    with pytest.raises(KVFormatError, match=match):
        KVBlock.from_bytes(_forge(meta_patch, tensors_patch))


def _with_header(raw: bytes, header: dict) -> bytes:
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + raw[8 + int.from_bytes(raw[:8], "little") :]


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:5],
        lambda b: b[: len(b) // 2],
        lambda b: b"\xff" * 8 + b[8:],
        lambda b: b[:8] + b"{not json" + b[17:],
        lambda b: b"",
        lambda b: (10).to_bytes(8, "little") + json.dumps({"__metadata__": {"format": 1}}).encode()[:10],
        lambda b: _with_header(b, {"__metadata__": {"cagkv": "{not json"}}),
        lambda b: _with_header(b, {"__metadata__": {"other": "x"}}),
        lambda b: _with_header(b, {"__metadata__": {"cagkv": "[]"}}),
    ],
)
def test_garbage_bytes_refused(mangle):
    with pytest.raises(CorruptBlobError):
        KVBlock.from_bytes(mangle(make_block().to_bytes()))


def test_constructor_validates_shapes():
    b = make_block()
    with pytest.raises(KVFormatError):
        KVBlock(b.keys, b.values[:, :, :3], b.token_ids, b.offsets, b.text, "fp")
    with pytest.raises(KVFormatError):
        KVBlock(b.keys.to(torch.int32), b.values.to(torch.int32), b.token_ids, b.offsets, b.text, "fp")


def test_empty_block_round_trips():
    b = KVBlock(
        torch.zeros(2, 1, 0, 4), torch.zeros(2, 1, 0, 4), torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 2, dtype=torch.int64), "", "fp",
    )
    assert KVBlock.from_bytes(b.to_bytes()).num_tokens == 0
    assert KVBlock.from_bytes(b.to_bytes("int8")).num_tokens == 0
