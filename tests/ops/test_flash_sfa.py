"""FlashSFA Triton kernels (:mod:`sieve_attn.ops.sfa.flash_sfa`, ``sfa_attention(backend="triton")``) against the
fp64 reference.

Rule (FlashAttention's): the kernel's error against fp64 is at most twice the error of PyTorch's own attention in the
same dtype against fp64, plus a small floor, for the output, the log-sum-exp and dq, dk, dv. PyTorch's own attention
is SDPA on the zero-filled sparsified q and k (the reference's own sparsify, so the selection is identical); for the
log-sum-exp, which SDPA does not return, and with softcap, which it lacks, the reference run in the same dtype.
Without CUDA the kernels run in the Triton interpreter (tests/conftest.py) on tiny shapes that still span several
query and key tiles, the causal diagonal and ragged last tiles.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import sieve_attn.ops.sfa.flash_sfa as flash_module  # noqa: E402
from sieve_attn import sfa_attention, sparse_codes  # noqa: E402
from sieve_attn.ops.sfa.codes import densify, sparsify  # noqa: E402
from sieve_attn.ops.sfa.flash_sfa import dense_cuda_core_attention, sfa_attention_from_codes, tiling  # noqa: E402

try:
    from tests.backends import runs_backend  # noqa: E402
except ImportError:  # pytest imported the test modules with tests/ on the path
    from backends import runs_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# Absolute floor of the bound: float32 SDPA can be within 1e-7 of fp64, closer than any other summation order.
FLOOR = {F32: 2e-6, F16: 5e-4, BF16: 1e-3}
LSE_FLOOR = 1e-5


def _qkv(batch, hq, hkv, tq, tk, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, t, dim, generator=gen, dtype=F64).to(dtype).to(DEVICE)
            for h, t in ((hq, tq), (hkv, tk), (hkv, tk))]


def _causal_mask(tq, tk):
    """bool [Tq, Tk]: query i sits at key position Tk - Tq + i and attends keys at or before it."""
    return torch.arange(tk, device=DEVICE)[None, :] <= torch.arange(tk - tq, tk, device=DEVICE)[:, None]


def _run(attend, q, k, v, grad):
    """[out, lse, dq, dk, dv] of attend(q, k, v) -> (out, lse) under the output gradient ``grad``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attend(q, k, v)
    out.backward(grad.to(out.dtype))
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _sfa(backend, **kw):
    return lambda q, k, v: sfa_attention(q, k, v, backend=backend, return_lse=True, **kw)


def _sdpa_sparse(topk, causal):
    """PyTorch's own attention in the inputs' dtype on the sparsified q and k (lse: none, NaN placeholder)."""
    def attend(q, k, v):
        mask = _causal_mask(q.shape[2], k.shape[2]) if causal else None
        out = F.scaled_dot_product_attention(sparsify(q, topk), sparsify(k, topk), v, attn_mask=mask,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out, torch.full(q.shape[:3], float("nan"))
    return attend


def _assert_flash_rule(case, names, got, exact, base, floor):
    for name, g, ref, b in zip(names, got, exact, base):
        assert not torch.isnan(g).any(), f"{case} {name}: NaN"
        err = (g.double() - ref).abs().max().item()
        bound = 2 * (b.double() - ref).abs().max().item() + floor
        assert err <= bound, f"{case} {name}: error {err:.3g} > bound {bound:.3g}"


# (batch, q_heads, kv_heads, Tq, Tk, head_dim, topk, causal, softcap, dtype); Tq < Tk is a decode-like chunk.
CASES = {
    "mha-T63-D32-k4-causal-f32": (1, 2, 2, 63, 63, 32, 4, True, None, F32),
    "gqa-T97-D64-k8-full-bf16": (1, 4, 2, 97, 97, 64, 8, False, None, BF16),
    "mqa-T63-D32-k1-causal-bf16": (2, 3, 1, 63, 63, 32, 1, True, None, BF16),
    "mqa-T63-D32-kD-causal-f32": (1, 2, 1, 63, 63, 32, 32, True, None, F32),
    "mha-T63-D64-k8-full-f16": (1, 2, 2, 63, 63, 64, 8, False, None, F16),
    "gqa-T40-D32-k4-causal-softcap-f32": (1, 4, 2, 40, 40, 32, 4, True, 0.7, F32),
    "decode-gqa-Tq5-Tk97-D32-k4-causal-bf16": (1, 4, 2, 5, 97, 32, 4, True, None, BF16),
    "decode-mqa-Tq17-Tk63-D64-k8-full-f32": (2, 2, 1, 17, 63, 64, 8, False, None, F32),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_forward_and_backward(case):
    batch, hq, hkv, tq, tk, dim, topk, causal, softcap, dtype = CASES[case]
    q, k, v = _qkv(batch, hq, hkv, tq, tk, dim, dtype, seed=len(case))
    grad = torch.randn(batch, hq, tq, dim, generator=torch.Generator().manual_seed(1), dtype=F64).to(DEVICE)
    kw = dict(topk=topk, causal=causal, softcap=softcap)
    exact = _run(_sfa("reference", **kw), q.double(), k.double(), v.double(), grad)
    with runs_backend("sfa", "triton"):
        got = _run(_sfa("triton", **kw), q, k, v, grad)
    reference_low = _run(_sfa("reference", **kw), q, k, v, grad)
    base = reference_low if softcap else _run(_sdpa_sparse(topk, causal), q, k, v, grad)
    names = ("out", "dq", "dk", "dv")
    _assert_flash_rule(case, names, got[:1] + got[2:], exact[:1] + exact[2:], base[:1] + base[2:], FLOOR[dtype])
    _assert_flash_rule(case, ("lse",), got[1:2], exact[1:2], reference_low[1:2], LSE_FLOOR)
    assert got[1].dtype == F32 and got[0].dtype == dtype
    # straight-through: no gradient outside the kept coordinates
    assert torch.all(got[2][sparsify(q, topk) == 0] == 0) and torch.all(got[3][sparsify(k, topk) == 0] == 0)


def test_topk_d_is_dense_attention():
    q, k, v = _qkv(1, 2, 1, 33, 33, 32, F32, seed=3)
    grad = torch.randn(1, 2, 33, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    got = _run(_sfa("triton", topk=32), q, k, v, grad)
    dense = _run(lambda q, k, v: (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                  torch.zeros(())), q, k, v, grad)
    for name, g, want in zip(("out", "dq", "dk", "dv"), got[:1] + got[2:], dense[:1] + dense[2:]):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("index_dtype", [torch.uint8, torch.int32])
def test_from_codes_reads_only_the_codes(index_dtype):
    """The kernels take the (index, value) codes alone: no dense q or k exists in the call."""
    q, k, v = _qkv(1, 4, 2, 40, 40, 32, F32, seed=5)
    codes = [c.detach().clone() for x in (q, k) for c in sparse_codes(x, 6)]
    del q, k
    q_idx, q_val, k_idx, k_val = codes[0].to(index_dtype), codes[1], codes[2].to(index_dtype), codes[3]
    q_val.requires_grad_()
    k_val.requires_grad_()
    out, lse = sfa_attention_from_codes(q_idx, q_val, k_idx, k_val, v, softcap=2.0)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got = torch.autograd.grad((out * weight).sum(), (q_val, k_val))

    q64, k64 = (val.detach().double().requires_grad_() for val in (q_val, k_val))
    ref, ref_lse = sfa_attention(densify(q_idx, q64, 32), densify(k_idx, k64, 32), v.double(), topk=32,
                                 softcap=2.0, backend="reference", return_lse=True)
    want = torch.autograd.grad((ref * weight.double()).sum(), (q64, k64))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)  # both float32
    for name, g, w in zip(("q_val", "k_val"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_pairs_without_a_shared_coordinate_score_zero(dtype):
    """The forward's S = Qd @ Kd^T over zero-filled tiles: queries on coordinates 0-3 and keys on 4-7 share none, so
    every logit is exactly 0 and each query averages V over the keys it attends, lse = log(their count)."""
    batch, heads, length, dim = 1, 2, 40, 32
    gen = torch.Generator().manual_seed(11)
    slots = torch.arange(4).expand(batch, heads, length, 4)
    q_idx, k_idx = slots.to(torch.uint8).to(DEVICE), (slots + 4).to(torch.uint8).to(DEVICE)
    q_val, k_val = (torch.randn(batch, heads, length, 4, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    v = torch.randn(batch, heads, length, dim, generator=gen).to(dtype).to(DEVICE)
    out, lse = sfa_attention_from_codes(q_idx, q_val, k_idx, k_val, v, causal=True)
    count = torch.arange(1, length + 1, dtype=F64, device=DEVICE)
    want = v.double().cumsum(2) / count[:, None]
    tol = 1e-6 if dtype == F32 else 1e-2
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    torch.testing.assert_close(lse.double(), count.log().expand(batch, heads, length), rtol=0, atol=1e-5)


# The later query tiles do read the poisoned keys: their NaN row maxima warn in the interpreter.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_causal_key_tiles_after_the_query_tile_are_never_read():
    """Keys after a query tile's last position are skipped by whole tiles: NaN there cannot reach the tile."""
    block = tiling(torch.device(DEVICE)).block_m
    q, k, v = _qkv(1, 2, 1, 2 * block, 2 * block, 32, F32, seed=7)
    q_idx, q_val = sparse_codes(q, 4)
    k_idx, k_val = sparse_codes(k, 4)
    clean, _ = sfa_attention_from_codes(q_idx, q_val, k_idx, k_val, v)
    k_val[:, :, block:] = float("nan")
    v = v.clone()
    v[:, :, block:] = float("nan")
    poisoned, _ = sfa_attention_from_codes(q_idx, q_val, k_idx, k_val, v)
    assert torch.equal(poisoned[:, :, :block], clean[:, :, :block])


def test_out_poisoned_with_nan_is_overwritten():
    q, k, v = _qkv(2, 4, 2, 63, 63, 32, BF16, seed=8)
    want = sfa_attention(q, k, v, topk=4, backend="triton")
    out = torch.full_like(q, float("nan"))
    with runs_backend("sfa", "triton"):
        got = sfa_attention(q, k, v, topk=4, backend="triton", out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)


DENSE_CASES = {
    "gqa-T63-D32-causal-f32": (1, 4, 2, 63, 63, 32, True, F32),
    "mqa-Tq7-Tk70-D64-full-bf16": (1, 2, 1, 7, 70, 64, False, BF16),
    "mha-Tq20-Tk45-D32-causal-bf16": (2, 2, 2, 20, 45, 32, True, BF16),
}


@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_cuda_core_kernel_matches_sdpa(case):
    batch, hq, hkv, tq, tk, dim, causal, dtype = DENSE_CASES[case]
    q, k, v = _qkv(batch, hq, hkv, tq, tk, dim, dtype, seed=len(case))
    mask = _causal_mask(tq, tk) if causal else None

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)

    out, lse = dense_cuda_core_attention(q, k, v, causal)
    exact = sdpa(q.double(), k.double(), v.double())
    _assert_flash_rule(case, ("out",), [out], [exact], [sdpa(q, k, v)], FLOOR[dtype])
    scores = q.double() @ k.double().repeat_interleave(hq // hkv, 1).transpose(-1, -2) * dim ** -0.5
    exact_lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")) if causal else scores, dim=-1)
    assert lse.dtype == F32 and (lse.double() - exact_lse).abs().max() < LSE_FLOOR


def test_auto_keeps_the_reference_on_the_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("auto took the Triton kernels")

    monkeypatch.setattr(flash_module, "flash_sfa_attention", refuse)
    q = torch.randn(1, 2, 8, 16)
    assert sfa_attention(q, q, q, topk=4).shape == q.shape


@pytest.mark.parametrize("kwargs,message", [
    (dict(attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool, device=DEVICE)), "attn_mask"),
    (dict(q=torch.randn(1, 2, 8, 24, device=DEVICE)), "head dims"),
    (dict(q=torch.randn(1, 2, 8, 16, dtype=F64, device=DEVICE)), "float16, bfloat16 or float32"),
])
def test_explicit_triton_refuses_what_it_cannot_compute(kwargs, message):
    q = kwargs.pop("q", torch.randn(1, 2, 8, 16, device=DEVICE))
    with pytest.raises(ValueError, match=f"backend: .*{message}"):
        sfa_attention(q, q, q, topk=4, backend="triton", **kwargs)


@pytest.mark.skipif(DEVICE == "cuda", reason="needs tensors the kernels cannot take: CPU ones without the interpreter")
def test_kernel_entry_points_refuse_tensors_the_kernels_cannot_take(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(1, 2, 1, 8, 8, 16, F32, seed=9)
    with pytest.raises(ValueError, match="^q_val, k_val, v: expected tensors the FlashSFA kernels can take, got the "
                                         "Triton kernels run on CUDA devices"):
        sfa_attention_from_codes(*sparse_codes(q, 4), *sparse_codes(k, 4), v)
    with pytest.raises(ValueError, match="^q: expected tensors the FlashSFA kernels can take, got the Triton "
                                         "kernels run on CUDA devices"):
        dense_cuda_core_attention(q, k, v)


def test_from_codes_rejects_malformed_codes():
    q, k, v = _qkv(1, 2, 1, 8, 8, 16, F32, seed=9)
    (qi, qv), (ki, kv) = sparse_codes(q, 4), sparse_codes(k, 4)
    bad = {
        "q_idx": (qi.float(), qv, ki, kv, v),
        "k_idx": (qi, qv, ki[:, :, :4], kv[:, :, :4], v),
        "q_val, k_val": (qi, qv.half(), ki, kv, v),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match=name):
            sfa_attention_from_codes(*args)
    with pytest.raises(ValueError, match="q_idx"):  # topk of q and k differ
        sfa_attention_from_codes(*sparse_codes(q, 3), ki, kv, v)
