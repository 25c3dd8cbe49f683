"""``sfa_attention(backend="sdpa")``: PyTorch's dense attention on the zero-filled sparse q and k, against the fp64
reference.

Rule (FlashAttention's): the error against fp64 is at most twice the error of PyTorch's own attention in the same
dtype, plus a small floor, for the output and dq, dk, dv. The yardstick is built here without the backend's code:
the test's own sparsified q and k, K/V heads repeated for each query head, and a causal mask written out, so a
wrong mask alignment, head mapping or selection in the backend shows as an error far above it. On a GPU the same
cases run the kernels SDPA picks there (cuDNN or FlashAttention).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import sieve_attn.ops.sfa.attention as attention_module
from sieve_attn import sfa_attention
from sieve_attn.ops.sfa.attention import sfa_backend
from sieve_attn.ops.sfa.codes import sparsify
from sieve_attn.ops.triton_common import triton

try:
    from tests.backends import runs_backend
except ImportError:  # pytest imported the test modules with tests/ on the path
    from backends import runs_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOOR = {F32: 2e-6, F16: 5e-4, BF16: 1e-3}


def _qkv(batch, hq, hkv, tq, tk, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, t, dim, generator=gen, dtype=F64).to(dtype).to(DEVICE)
            for h, t in ((hq, tq), (hkv, tk), (hkv, tk))]


def _run(backend, q, k, v, grad, **kw):
    """[out, dq, dk, dv] of sfa_attention with ``backend`` under the output gradient ``grad``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = sfa_attention(q, k, v, backend=backend, **kw)
    out.backward(grad.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _pytorch_own(q, k, v, grad, *, topk, causal, attn_mask=None):
    """[out, dq, dk, dv] of PyTorch's dense attention on the sparsified inputs, heads repeated, mask written out;
    rows without an attended key give 0."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=DEVICE)
    if causal:
        mask = torch.tensor([[j <= tk - tq + i for j in range(tk)] for i in range(tq)], device=DEVICE)
    if attn_mask is not None:
        mask = mask & attn_mask
    rows = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(sparsify(q, topk), sparsify(k, topk).repeat_interleave(group, 1),
                                         v.repeat_interleave(group, 1), attn_mask=mask | ~rows)
    out = torch.where(rows, out, 0.0)
    out.backward(grad.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _assert_rule(case, got, exact, base, floor):
    for name, g, ref, b in zip(("out", "dq", "dk", "dv"), got, exact, base):
        assert not torch.isnan(g).any(), f"{case} {name}: NaN"
        err = (g.double() - ref).abs().max().item()
        bound = 2 * (b.double() - ref).abs().max().item() + floor
        assert err <= bound, f"{case} {name}: error {err:.3g} > bound {bound:.3g}"


# (batch, q_heads, kv_heads, Tq, Tk, head_dim, topk, causal, dtype); Tq < Tk is a chunk after a cache.
CASES = {
    "mha-T63-D32-k4-causal-f32": (1, 2, 2, 63, 63, 32, 4, True, F32),
    "gqa-T97-D64-k8-full-bf16": (1, 4, 2, 97, 97, 64, 8, False, BF16),
    "mqa-T63-D32-k1-causal-bf16": (2, 3, 1, 63, 63, 32, 1, True, BF16),
    "mqa-T63-D24-kD-causal-f32": (1, 2, 1, 63, 63, 24, 24, True, F32),
    "mha-T63-D64-k8-full-f16": (1, 2, 2, 63, 63, 64, 8, False, F16),
    "chunk-gqa-Tq5-Tk97-D32-k4-causal-bf16": (1, 4, 2, 5, 97, 32, 4, True, BF16),
    "chunk-mqa-Tq17-Tk63-D64-k8-full-f32": (2, 2, 1, 17, 63, 64, 8, False, F32),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_forward_and_backward(case):
    batch, hq, hkv, tq, tk, dim, topk, causal, dtype = CASES[case]
    if dtype == F16 and DEVICE == "cpu":
        pytest.skip("float16 attention on the CPU is PyTorch's math path in float32 inputs' clothing: no yardstick")
    q, k, v = _qkv(batch, hq, hkv, tq, tk, dim, dtype, seed=len(case))
    grad = torch.randn(batch, hq, tq, dim, generator=torch.Generator().manual_seed(1), dtype=F64).to(DEVICE)
    kw = dict(topk=topk, causal=causal)
    exact = _run("reference", q.double(), k.double(), v.double(), grad, **kw)
    with runs_backend("sfa", "sdpa"):
        got = _run("sdpa", q, k, v, grad, **kw)
    _assert_rule(case, got, exact, _pytorch_own(q, k, v, grad, **kw), FLOOR[dtype])
    assert got[0].dtype == dtype
    # straight-through: no gradient outside the kept coordinates
    assert torch.all(got[1][sparsify(q, topk) == 0] == 0) and torch.all(got[2][sparsify(k, topk) == 0] == 0)


@pytest.mark.parametrize("q_len, empty_rows", [(33, 5), (5, 3)], ids=["square", "queries-at-the-end"])
def test_padding_mask_and_a_fully_masked_row_into_a_poisoned_out(q_len, empty_rows):
    """A padding mask ANDed with causality, the queries the last Tq of Tk = 33 positions (the causal diagonal aligned
    bottom-right); a query with no attended key returns 0 and passes no gradient (dense kernels differ there, some
    giving NaN); ``out`` poisoned with NaN is overwritten."""
    q, k, v = _qkv(2, 4, 2, q_len, 33, 32, F32, seed=9)
    mask = torch.ones(2, 1, q_len, 33, dtype=torch.bool, device=DEVICE)
    # Sequence 0: keys up to the position of query empty_rows - 1 are padding, so queries 0 .. empty_rows - 1
    # attend nothing.
    mask[0, :, :, :33 - q_len + empty_rows] = False
    grad = torch.randn(2, 4, q_len, 32, generator=torch.Generator().manual_seed(2), dtype=F64).to(DEVICE)
    kw = dict(topk=6, causal=True, attn_mask=mask)
    with runs_backend("sfa", "sdpa"):
        got = _run("sdpa", q, k, v, grad, **kw)
    exact = _run("reference", q.double(), k.double(), v.double(), grad, **kw)
    _assert_rule("padding", got, exact, _pytorch_own(q, k, v, grad, **kw), FLOOR[F32])
    assert torch.all(got[0][0, :, :empty_rows] == 0) and torch.all(got[1][0, :, :empty_rows] == 0)
    assert got[0][0, :, empty_rows:].abs().amax(dim=-1).min() > 0
    out = torch.full_like(q, float("nan"))
    assert sfa_attention(q, k, v, backend="sdpa", out=out, **kw) is out
    torch.testing.assert_close(out, got[0], rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, message", [({"softcap": 2.0}, "softcap: expected None with backend 'sdpa' .*got 2.0"),
                                             ({"return_lse": True}, "return_lse: expected False with backend 'sdpa' "
                                                                    ".*got True")])
def test_refuses_what_sdpa_cannot_compute(kwargs, message):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, F32, seed=0)
    with pytest.raises(ValueError, match=f"^{message}"):
        sfa_attention(q, k, v, topk=4, backend="sdpa", **kwargs)


# ---------------------------------------------------------------------------------------------------- auto dispatch

def _stand_in(device="cuda", dtype=BF16, head_dim=128):
    """A stand-in for q [1, 8, 64, D]: the dispatch reads only its shape, device and dtype, so CUDA is decided here
    without a GPU."""
    return SimpleNamespace(shape=(1, 8, 64, head_dim), device=torch.device(device), dtype=dtype)


PADDING = torch.ones(1, 1, 64, 64, dtype=torch.bool)
# The Triton kernels take the CUDA stand-in when triton is installed (kernel_blocker reads no GPU).
KERNELS = "triton" if triton is not None else "reference"


@pytest.mark.parametrize("kwargs", [{}, {"attn_mask": PADDING}, {"q": _stand_in(dtype=F64)},
                                    {"q": _stand_in(head_dim=24)}, {"q": _stand_in(device="cuda:1", dtype=F16)}])
def test_auto_takes_sdpa_on_cuda_whenever_it_can(kwargs):
    """Measured on the H200 (bf16, H=8, D=128): sdpa beats FlashSFA at every length timed (64K, k=8: forward 16.46
    vs 113.8 ms, forward+backward 54.97 vs 2228 ms), so auto takes it for every CUDA call it can compute: padding
    masks, float64 and head dims the Triton kernels refuse included."""
    q = kwargs.pop("q", _stand_in())
    backend, reason = sfa_backend(q, backend="auto", **kwargs)
    assert backend == "sdpa" and reason.startswith("auto on CUDA")


@pytest.mark.parametrize("kwargs, missing", [({"softcap": 30.0}, "softcap"), ({"return_lse": True}, "log-sum-exp")])
def test_auto_on_cuda_falls_back_to_the_kernels_then_the_reference(kwargs, missing):
    """What sdpa cannot compute (softcap, log-sum-exp) goes to the Triton kernels when they take the call, else to
    the reference, the reason naming both refusals."""
    backend, reason = sfa_backend(_stand_in(), **kwargs)
    assert backend == KERNELS and missing in reason
    for blocked, blocker in [({"attn_mask": PADDING}, "attn_mask"), ({"q": _stand_in(dtype=F64)}, "float16"),
                             ({"q": _stand_in(head_dim=24)}, "head dims")]:
        q = blocked.pop("q", _stand_in())
        backend, reason = sfa_backend(q, **kwargs, **blocked)
        assert backend == "reference" and missing in reason and (triton is None or blocker in reason), reason


@pytest.mark.parametrize("kwargs", [{}, {"softcap": 30.0}, {"return_lse": True}, {"attn_mask": PADDING}])
def test_auto_keeps_the_reference_off_cuda(kwargs):
    """Nothing was timed on the CPU: auto stays the reference there, whatever the arguments."""
    backend, reason = sfa_backend(_stand_in(device="cpu", dtype=F32), **kwargs)
    assert backend == "reference" and "cpu" in reason


def test_explicit_backends_are_taken_as_requested_on_cuda():
    q = _stand_in()
    assert sfa_backend(q, backend="reference", softcap=30.0) == ("reference", "requested")
    assert sfa_backend(q, backend="sdpa") == ("sdpa", "requested")
    if triton is not None:
        assert sfa_backend(q, backend="triton") == ("triton", "requested")
    with pytest.raises(ValueError, match="^softcap: expected None with backend 'sdpa'"):
        sfa_backend(q, backend="sdpa", softcap=30.0)


def test_sfa_attention_runs_the_backend_the_resolver_names(monkeypatch):
    """sfa_attention computes the call with the backend ``_resolve`` names (the one sfa_backend reports): here sdpa
    under auto, as on CUDA, and the result is sdpa's."""
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, F32, seed=3)
    calls = []
    monkeypatch.setattr(attention_module, "_resolve", lambda *args: calls.append(args[-1]) or ("sdpa", "test"))
    with runs_backend("sfa", "sdpa"):
        got = sfa_attention(q, k, v, topk=4)
    assert calls == ["auto"]
    want = attention_module.sfa_attention_sdpa(q, k, v, topk=4, causal=True, scale=16 ** -0.5, attn_mask=None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
