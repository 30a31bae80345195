"""The translation path runs on an accelerator and computes there what it computes on the CPU.

Skipped without CUDA (CI has none); run on a GPU machine with
`pytest tests/unit/test_device.py`. Each test moves a tiny target to the GPU and compares
the GPU's answer with the CPU's on the same inputs, in float32.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_folded import random_translator  # noqa: E402
from translate_fixtures import CORPUS, chunk_block, tiny_model  # noqa: E402

from cagkv.pipeline import CAG  # noqa: E402
from cagkv.prefill import prefill_chunks  # noqa: E402
from cagkv.prompt import PromptFormat  # noqa: E402
from cagkv.refresh import feed  # noqa: E402
from cagkv.translate import Translator  # noqa: E402
from cagkv.translate.dispatch import dispatch_experts  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_float32_matmul():
    """TF32 would make the GPU's float32 products differ from the CPU's by ~1e-3."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def on_gpu(loaded):
    return dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).to("cuda"))


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    got = got.float().cpu()
    assert torch.isfinite(got).all()
    assert float((got - want.float()).norm() / want.float().norm().clamp_min(1e-12)) < tol


@pytest.mark.parametrize("target_family", ["gemma3", "qwen2"])
def test_translate_many_on_gpu_matches_cpu(target_family: str) -> None:
    src, tgt = tiny_model("llama", 3), tiny_model(target_family, 4)
    card = {"source": {"fingerprint": src.fingerprint}, "target": {"fingerprint": tgt.fingerprint}}
    blocks = [chunk_block(src, CORPUS[0]), chunk_block(src, CORPUS[1][:60])]  # padded batch
    for folded in (True, False):
        tr = Translator(random_translator(src, tgt), card)
        tr.set_linear_path(torch.float32, folded=folded)
        want = tr.translate_many(blocks, tgt)
        got = tr.translate_many(blocks, on_gpu(tgt))
        for g, w in zip(got, want):
            assert g.keys.is_cuda and g.values.is_cuda
            close(g.keys, w.keys)
            close(g.values, w.values)
        back = tr.translate_many(blocks, tgt)  # and back: the network follows the target
        torch.testing.assert_close(back[0].keys, want[0].keys)


def test_prefill_chunks_on_gpu_matches_cpu() -> None:
    src = tiny_model("gemma3", 4)  # sliding windows, q/k-norm, two RoPE bases
    texts = [CORPUS[0], CORPUS[2][:50]]
    want = prefill_chunks(src, texts)
    got = prefill_chunks(on_gpu(src), texts)
    for g, w in zip(got, want):
        close(g.keys, w.keys)
        close(g.values, w.values)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_assemble_and_fused_feed_on_gpu_match_cpu(family: str) -> None:
    """Translated-like blocks (no separator) assembled, the separators computed in the
    question's forward (`feed` with stale entries): the first token's logits agree."""
    lm = tiny_model(family, 4)
    fmt = PromptFormat.for_model(lm)
    blocks = [chunk_block(lm, t) for t in (CORPUS[0], CORPUS[1][:70], CORPUS[3][:40])]
    question = fmt.question_suffix_ids("What is it?")
    logits = []
    for loaded in (lm, on_gpu(lm)):
        engine = CAG(store=None, canonical=lm.name)
        moved = [dataclasses.replace(b, keys=b.keys.to(loaded.device), values=b.values.to(loaded.device)) for b in blocks]
        cache, n, pending, _, stale = engine.assemble(loaded, fmt, moved)
        assert stale  # the separators between blocks are left to the question's forward
        _, out = feed(loaded.model, cache, n, pending + question, stale=stale)
        logits.append(out)
    close(logits[1], logits[0])


def test_dispatch_implementations_agree_on_gpu() -> None:
    g = torch.Generator().manual_seed(0)
    n, d, h, n_exp, k = 4096, 64, 128, 8, 2
    x = torch.randn(n, d, generator=g)
    W1, W2 = torch.randn(n_exp, d, h, generator=g) / d**0.5, torch.randn(n_exp, h, d, generator=g) / h**0.5
    b1, b2 = torch.randn(n_exp, h, generator=g), torch.randn(n_exp, d, generator=g)
    top = torch.randn(n, n_exp, generator=g).topk(k, dim=1)
    idx, gate = top.indices, torch.softmax(top.values, 1)
    want = dispatch_experts(x.double(), idx, gate.double(), W1.double(), b1.double(), W2.double(), b2.double(),
                            impl="dense")
    args = [t.cuda() for t in (x, idx, gate, W1, b1, W2, b2)]
    for impl in ("dense", "loop", "bmm", "auto"):
        close(dispatch_experts(*args, impl=impl), want)
    bf16 = [t if t.dtype == torch.int64 else t.bfloat16() for t in args]
    for impl in ("loop", "bmm", "grouped", "auto"):  # grouped_mm on CUDA takes bfloat16
        close(dispatch_experts(*bf16, impl=impl), want, tol=2e-2)


def test_refresh_scoring_on_gpu_matches_cpu() -> None:
    """Contrast scoring (eager attention, batched prompts) chooses the same tokens on the GPU."""
    from cagkv.pipeline import NEUTRAL_QUESTIONS

    lm = tiny_model("gemma3", 4)
    fmt = PromptFormat.for_model(lm)
    blocks = [chunk_block(lm, t) for t in (CORPUS[0], CORPUS[1][:70])]
    question = fmt.question_suffix_ids("What is it?")
    chosen, logits = [], []
    for loaded in (lm, on_gpu(lm)):
        engine = CAG(store=None, canonical=lm.name)
        moved = [dataclasses.replace(b, keys=b.keys.to(loaded.device), values=b.values.to(loaded.device)) for b in blocks]
        cache, n, pending, starts, stale = engine.assemble(loaded, fmt, moved, keep_all=True)
        neutral = [pending + fmt.question_suffix_ids(q) for q in NEUTRAL_QUESTIONS]
        picked = engine.refresh(loaded, cache, n, pending + question, zip(starts, moved), 0.3, neutral, "contrast",
                                defer=True)
        _, out = feed(loaded.model, cache, n, pending + question, stale={**stale, **picked})
        chosen.append(picked)
        logits.append(out)
    assert chosen[0] == chosen[1] and chosen[0]
    close(logits[1], logits[0])


def test_engine_on_gpu_answers_as_on_cpu(tmp_path) -> None:
    """`CAG(device="cuda")` end to end: canonical and native answers equal the CPU engine's."""
    from engine_helpers import make_model_dir

    from cagkv.ingest import ingest

    model = str(make_model_dir(tmp_path / "m", "llama", chat=True))
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper lived on the island for thirty years. Every night he lit the lamp.")
    ingest([str(doc)], tmp_path / "store", canonical=model, dtype="float32", embedder="hash-64", progress=False)
    question = "How long did the keeper live there?"
    for mode in ("canonical", "native"):
        cpu = CAG.open(str(tmp_path / "store")).ask(question, mode=mode, max_new_tokens=8)
        gpu_cag = CAG.open(str(tmp_path / "store"), device="cuda")
        gpu = gpu_cag.ask(question, mode=mode, max_new_tokens=8)
        assert gpu_cag.model(model).device.type == "cuda"
        assert gpu.token_ids == cpu.token_ids, mode


def test_ingest_on_gpu_stores_what_the_cpu_stores(tmp_path) -> None:
    """`ingest(device="cuda")`: the stored blocks (read back on the host) equal a CPU ingest's."""
    from engine_helpers import make_model_dir

    from cagkv.ingest import ingest
    from cagkv.stores import CacheStore

    model = str(make_model_dir(tmp_path / "m", "gemma3_text"))
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(CORPUS[:3]))
    blocks = {}
    for device in ("cpu", "cuda"):
        ingest([str(doc)], tmp_path / device, canonical=model, dtype="float32", embedder="hash-64",
               progress=False, device=device, chunk_tokens=32)
        store = CacheStore.open(tmp_path / device, create=False)
        try:
            blocks[device] = store.load_blocks([h.chunk_id for d in store.list_documents() for h in store.chunks_of(d.id)])
        finally:
            store.close()
    assert len(blocks["cuda"]) == len(blocks["cpu"]) > 1
    for g, w in zip(blocks["cuda"], blocks["cpu"]):
        assert g.keys.device.type == "cpu" and torch.equal(g.token_ids, w.token_ids)
        close(g.keys, w.keys)
        close(g.values, w.values)
