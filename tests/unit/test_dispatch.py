"""Sparse expert dispatch equals the dense masked reference (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from cagkv.translate.dispatch import dispatch_experts, load_balance_loss


def _weights(n_exp: int, d: int, h: int, o: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.3).requires_grad_(True)  # noqa: E731
    return mk(n_exp, d, h), mk(n_exp, h), mk(n_exp, h, o), mk(n_exp, o)


def _routing(n: int, n_exp: int, k: int, seed: int = 1, skip: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_exp) if e not in skip])
    scores = torch.randn(n, len(allowed), generator=g)
    top = scores.topk(min(k, len(allowed)), dim=1)
    return allowed[top.indices], torch.softmax(top.values, dim=1)


@pytest.mark.parametrize("impl", ["loop", "bmm", "grouped", "auto"])
@pytest.mark.parametrize("n,n_exp,k", [(1, 1, 1), (7, 4, 1), (33, 4, 2), (64, 8, 2), (5, 8, 2), (0, 4, 2)])
def test_sparse_equals_dense(impl: str, n: int, n_exp: int, k: int) -> None:
    d, h, o = 8, 12, 16
    W1, b1, W2, b2 = _weights(n_exp, d, h, o)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(2))
    idx, gate = _routing(n, n_exp, k)
    ref = dispatch_experts(x, idx, gate, W1, b1, W2, b2, impl="dense")
    got = dispatch_experts(x, idx, gate, W1, b1, W2, b2, impl=impl)
    assert got.shape == (n, o)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["loop", "bmm", "grouped"])
def test_empty_experts_and_gradients(impl: str) -> None:
    d, h, o, n_exp = 8, 8, 4, 6
    W1, b1, W2, b2 = _weights(n_exp, d, h, o, seed=3)
    x = torch.randn(40, d, requires_grad=True)
    idx, gate = _routing(40, n_exp, 2, skip=(0, 3, 5))  # experts 0, 3, 5 get nothing
    gate = gate.clone().requires_grad_(True)
    grads = []
    for mode in ("dense", impl):
        for t in (x, gate, W1, b1, W2, b2):
            t.grad = None
        y = dispatch_experts(x, idx, gate, W1, b1, W2, b2, impl=mode)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        grads.append([t.grad.clone() for t in (x, gate, W1, b1, W2, b2)])
    for g_ref, g_got in zip(*grads):
        torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-5)
    assert float(grads[1][2][0].abs().max()) == 0.0  # an unused expert gets no gradient


def test_one_hot_gate_selects_single_expert() -> None:
    d, h, o, n_exp = 4, 4, 4, 3
    W1, b1, W2, b2 = _weights(n_exp, d, h, o)
    x = torch.randn(5, d)
    idx = torch.full((5, 1), 2)
    y = dispatch_experts(x, idx, torch.ones(5, 1), W1, b1, W2, b2, impl="loop")
    ref = torch.nn.functional.silu(x @ W1[2] + b1[2]) @ W2[2] + b2[2]
    torch.testing.assert_close(y, ref)


def test_unknown_impl_rejected() -> None:
    W1, b1, W2, b2 = _weights(2, 4, 4, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch_experts(torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), W1, b1, W2, b2, impl="x")


def test_balance_loss_minimal_when_balanced() -> None:
    n_exp = 4
    probs = torch.full((8, n_exp), 0.25)
    idx = torch.arange(8).remainder(n_exp)[:, None]
    assert float(load_balance_loss(probs, idx, n_exp)) == pytest.approx(1.0)
    skew = torch.zeros(8, n_exp)
    skew[:, 0] = 1.0
    assert float(load_balance_loss(skew, torch.zeros(8, 1, dtype=torch.long), n_exp)) == pytest.approx(4.0)
