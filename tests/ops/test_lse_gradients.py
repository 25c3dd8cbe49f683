"""The log-sum-exp an op returns is part of its result: a loss on it gives q, k and v the gradients autograd of the
fp64 reference gives, on every backend that returns it under autograd; the backends that cannot refuse the call
(and ``auto`` does not pick them), as does a kernel without a backward."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops.focus.attention import focus_attention, focus_backend
from sieve_attn.ops.sfa.attention import sfa_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(q_len, k_len, q_heads=4, kv_heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((1, q_heads, q_len, dim), (1, kv_heads, k_len, dim), (1, kv_heads, k_len, dim))
    return [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]


def _gradients(attend, tensors, dtype, loss_on):
    """(out, lse, dq, dk, dv) of ``attend`` on copies of ``tensors`` in ``dtype``, for a fixed random loss on
    out, on lse, or on both."""
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in tensors]
    out, lse = attend(*leaves)
    generator = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(DEVICE)
    w_lse = torch.randn(lse.shape, generator=generator, dtype=torch.float64).to(DEVICE)
    loss = 0
    if loss_on in ("out", "both"):
        loss = loss + (out.double() * w_out).sum()
    if loss_on in ("lse", "both"):
        loss = loss + (lse.double() * w_lse).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # lse does not depend on v
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return [t.detach().double().cpu() for t in (out, lse, *grads)]


def _check(attend_fast, attend_reference, tensors, loss_on, atol=2e-5):
    expected = _gradients(attend_reference, tensors, torch.float64, loss_on)
    got = _gradients(attend_fast, tensors, torch.float32, loss_on)
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("loss_on", ["lse", "both"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_focus_lse_carries_gradient(backend, loss_on):
    groups = torch.randint(0, 3, (1, 37), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def attend(name):
        return lambda q, k, v: focus_attention(q, k, v, groups, window=4, backend=name, return_lse=True)
    _check(attend(backend), attend("reference"), _inputs(37, 37), loss_on)


@pytest.mark.parametrize("loss_on", ["lse", "both"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sfa_lse_carries_gradient(backend, loss_on):
    def attend(name):
        return lambda q, k, v: sfa_attention(q, k, v, topk=4, backend=name, return_lse=True)
    _check(attend(backend), attend("reference"), _inputs(37, 37), loss_on)


def test_backends_without_an_lse_gradient_or_a_backward_refuse_autograd():
    q, k, v = (t.float().to(DEVICE).requires_grad_() for t in _inputs(40, 40))
    groups = torch.zeros(1, 40, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="the sdpa backend's lse carries no gradient"):
        focus_attention(q, k, v, groups, backend="sdpa", return_lse=True)
    focus_attention(q, k, v, groups, backend="sdpa")  # out alone: its gradient is exact
    with torch.no_grad():
        focus_attention(q, k, v, groups, backend="sdpa", return_lse=True)
    # a decode step (Tq < Tk): the Triton decode kernel has no backward
    with pytest.raises(ValueError, match="the Triton decode kernel \\(Tq < Tk\\) has no backward"):
        focus_attention(q[:, :, -1:], k, v, groups, backend="triton")
    assert focus_backend(q[:, :, -1:], k, groups, v=v)[0] == "reference"
    with torch.no_grad():
        assert focus_backend(q[:, :, -1:], k, groups, v=v)[0] == ("triton" if DEVICE == "cuda" else "reference")


def test_focus_decode_under_autograd_gets_the_references_gradients():
    """``auto`` takes the reference for a decode step whose inputs require grad, so the output stays on the
    graph (the decode kernel's would not)."""
    tensors = _inputs(3, 37)
    groups = torch.randint(0, 3, (1, 37), generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def attend(name):
        return lambda q, k, v: focus_attention(q, k, v, groups, window=4, backend=name, return_lse=True)
    _check(attend("auto"), attend("reference"), tensors, "both")
