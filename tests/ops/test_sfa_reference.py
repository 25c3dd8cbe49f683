"""SFA (Sparse Feature Attention) reference and sparse codes against an independent fp64 oracle.

The oracle below is written from DESIGN.md and spec/sfa.md alone: top-k by |x| with torch.topk in float64, the
zero-filled q and k, K/V repeated per query head with repeat_interleave, a whole Tq x Tk boolean mask and a plain
softmax in float64. Nothing in it is imported from sieve_attn.
"""
from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F

import sieve_attn as sa
import sieve_attn.ops.blockwise as blockwise_module
import sieve_attn.ops.sfa.reference as reference_module
from sieve_attn import sfa_attention, sparse_codes
from sieve_attn.ops.sfa.codes import densify, sparsify

F64 = torch.float64
NEG_INF = float("-inf")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ----------------------------------------------------------------------------------------------------------------
# Independent oracle
# ----------------------------------------------------------------------------------------------------------------

def oracle_sparsify(x, topk):
    """(x with all but its top-k |x| coordinates zeroed, in float64; the bool mask of kept coordinates).

    Ties go to the lower coordinate index (the package's documented rule): the topk key shrinks each magnitude by a
    relative idx * 2**-40, far below the spacing of float32 (2**-24), so distinct magnitudes keep their order and
    equal ones are ordered by index. The mask is a constant, so autograd gives the straight-through gradient.
    """
    x = x.to(F64)
    shrink = 1 - torch.arange(x.shape[-1], dtype=F64) * 2.0 ** -40
    chosen = torch.topk(x.detach().abs() * shrink, topk, dim=-1).indices
    mask = torch.zeros(x.shape, dtype=torch.bool).scatter(-1, chosen, True)
    return x * mask, mask


def position_mask(q_len, k_len, causal):
    """bool [1, Tq, Tk]; query row r sits at key position Tk - Tq + r."""
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    return ((j <= i) if causal else torch.ones(q_len, k_len, dtype=torch.bool))[None]


def oracle_attention(q, k, v, mask, scale=None):
    """fp64 softmax attention; mask bool broadcastable to [B, Hq, Tq, Tk] ([B, Tq, Tk] is per batch).

    Returns (out [B, Hq, Tq, D], lse [B, Hq, Tq]) in float64; fully masked rows give 0 and -inf. Differentiable.
    """
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    mask = (mask[:, None] if mask.dim() == 3 else mask).expand_as(s)
    s = s.masked_fill(~mask, NEG_INF)
    has = mask.any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(has, s, torch.zeros_like(s)), dim=-1) * has
    return p @ v, torch.logsumexp(s, dim=-1)


def oracle_sfa(q, k, v, topk, mask, scale=None):
    return oracle_attention(oracle_sparsify(q, topk)[0], oracle_sparsify(k, topk)[0], v, mask, scale)


def sdpa_low(q_sparse, k_sparse, v, mask):
    """PyTorch's own attention in the inputs' dtype on the same sparsified q and k, with the same boolean mask."""
    rep = q_sparse.shape[1] // k_sparse.shape[1]
    return F.scaled_dot_product_attention(q_sparse, k_sparse.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask[:, None])


def make_qkv(batch, hq, hkv, tq, tk, dim, dtype=F64, requires_grad=False):
    q, k, v = (torch.randn(batch, h, t, dim, dtype=F64).to(dtype) for h, t in ((hq, tq), (hkv, tk), (hkv, tk)))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def assert_flash_rule(ours, torch_low, ref, slack=1e-5):
    err = (ours.to(F64) - ref).abs().max().item()
    base = (torch_low.to(F64) - ref).abs().max().item()
    assert err <= 2 * base + slack, f"error {err:.3e} > 2 x PyTorch's {base:.3e} + {slack}"


def test_oracle_sparsify_breaks_ties_by_lower_index():
    x = torch.tensor([[0.5, -2.0, 2.0, 1.0, -2.0, 3.0]])
    kept, mask = oracle_sparsify(x, 3)
    assert mask[0].tolist() == [False, True, True, False, False, True]
    assert kept[0].tolist() == [0.0, -2.0, 2.0, 0.0, 0.0, 3.0]


# ----------------------------------------------------------------------------------------------------------------
# 1. Sparse codes
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim,index_dtype", [(64, torch.uint8), (128, torch.uint8), (256, torch.uint8),
                                             (257, torch.int16), (512, torch.int16), (2 ** 15, torch.int16),
                                             (2 ** 15 + 1, torch.int32)])
def test_sparse_codes_index_dtype(dim, index_dtype):
    x = torch.randn(2, dim)
    indices, values = sparse_codes(x, 4)
    assert indices.dtype == index_dtype and indices.shape == (2, 4) and values.shape == (2, 4)
    assert torch.equal(indices.long(), torch.topk(x.abs(), 4).indices)


@pytest.mark.parametrize("dtype", DTYPES + [F64])
@pytest.mark.parametrize("dim,topk", [(64, 1), (64, 8), (128, 16), (128, 128), (512, 8)])
def test_sparse_codes_match_oracle_and_densify_equals_sparsify(dtype, dim, topk):
    torch.manual_seed(dim + topk)
    x = torch.randn(2, 3, 5, dim, dtype=F64).to(dtype)  # bf16/fp16 hold many equal magnitudes: ties are exercised
    indices, values = sparse_codes(x, topk)
    assert values.dtype == dtype and values.shape == (2, 3, 5, topk)
    assert torch.equal(values, x.gather(-1, indices.long()))
    dense = densify(indices, values, dim)
    assert dense.dtype == dtype and torch.equal(dense, sparsify(x, topk))
    assert torch.equal(dense.to(F64), oracle_sparsify(x, topk)[0])


def test_sparse_codes_order_and_ties():
    """Codes come by decreasing |x|; equal magnitudes by increasing index, whatever the memory layout."""
    # All magnitudes equal: torch 2.13's topk on the CPU returns 42, 43, 44, 41 for this vector.
    x = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0] * 8)
    assert sparse_codes(x, 5)[0].tolist() == [0, 1, 2, 3, 4]
    x = torch.tensor([0.5, -2.0, 2.0, 1.0, -2.0, 3.0, -3.0])
    indices, values = sparse_codes(x, 5)
    assert indices.tolist() == [5, 6, 1, 2, 4] and values.tolist() == [3.0, -3.0, -2.0, 2.0, -2.0]
    torch.manual_seed(1)
    y = torch.randn(64, 5, dtype=F64).to(torch.bfloat16).t()  # not contiguous along D
    assert torch.equal(sparse_codes(y, 9)[0], sparse_codes(y.contiguous(), 9)[0])


def test_sparsify_gradient_is_straight_through():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 64, dtype=F64, requires_grad=True)
    weight = torch.randn(3, 4, 64, dtype=F64)
    (grad,) = torch.autograd.grad((sparsify(x, 8) * weight).sum(), x)
    mask = oracle_sparsify(x, 8)[1]
    assert torch.equal(grad, weight * mask)
    (grad,) = torch.autograd.grad((sparse_codes(x, 8)[1] ** 2).sum(), x)
    assert torch.equal(grad, 2 * x.detach() * mask)


@pytest.mark.parametrize("dtype", DTYPES + [F64])
def test_weighted_sparsify_ranks_by_weighted_magnitude_and_keeps_the_values(dtype):
    """Coordinates rank by |x| * w (w broadcast per head), ties by index; the kept values are x's own; all-ones
    weights are the plain rule; the plain rule leaves a weighted result unchanged (which every SFA path relies on);
    gradients are straight through the weighted mask."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, 32, dtype=F64).to(dtype)
    weights = torch.rand(3, 1, 32) * 4  # float32 whatever x's dtype, as a calibrated layer keeps them
    kept = sparsify(x, 6, weights)
    ranked = oracle_sparsify(x.to(F64) * weights.to(F64), 6)[1]
    assert kept.dtype == dtype and torch.equal(kept, x * ranked)
    assert torch.equal(sparsify(kept, 6), kept)
    assert torch.equal(sparsify(x, 6, torch.ones(32)), sparsify(x, 6))
    assert torch.equal(sparsify(torch.tensor([1.0, 2.0, 1.0, 2.0]), 1, torch.tensor([2.0, 1.0, 2.0, 1.0])),
                       torch.tensor([1.0, 0.0, 0.0, 0.0]))  # |x| w ties at 2: the lower index
    leaf = x.to(F64).requires_grad_(True)
    upstream = torch.randn_like(leaf)
    (grad,) = torch.autograd.grad((sparsify(leaf, 6, weights) * upstream).sum(), leaf)
    assert torch.equal(grad, upstream * ranked)
    for bad, got in ((torch.ones(4, 1, 32), "shape \\(4, 1, 32\\)"), (torch.ones(16), "shape \\(16,\\)"),
                     (torch.ones(32, dtype=torch.long), "torch.int64"), (torch.ones(32, device="meta"), "meta"),
                     (-torch.ones(32), "a negative, infinite or NaN value"),
                     (torch.full((32,), float("nan")), "a negative, infinite or NaN value")):
        with pytest.raises(ValueError, match=f"weights: expected .*got {got}"):
            sparsify(x, 6, bad)
    with sa.skip_nan_checks():  # the value check reads the device; the layouts are still checked
        sparsify(x, 6, -torch.ones(32))
        with pytest.raises(ValueError, match="weights: expected a tensor broadcastable"):
            sparsify(x, 6, torch.ones(16))


# ----------------------------------------------------------------------------------------------------------------
# 2. Accuracy on odd shapes (the FlashAttention rule)
# ----------------------------------------------------------------------------------------------------------------

HEADS = [(4, 4), (6, 2), (4, 1)]
DIMS = [64, 128]
TOPKS = ["1", "8", "D"]


def _accuracy_cases():
    cases = []
    for length, (d_i, dtype), causal, (k_i, topk) in itertools.product(
            [1, 63, 257], enumerate(DTYPES), [True, False], enumerate(TOPKS)):
        # Latin-square choice of heads and D: for each T, every pair of factors (heads, D, dtype, causal, topk)
        # appears together in some case, with 54 cases instead of the 324 of the full product.
        hq, hkv = HEADS[(k_i + d_i) % 3]
        dim = DIMS[(int(causal) + d_i) % 2]
        batch = 1 if length > 100 else 2
        cases.append(pytest.param(length, dtype, causal, topk, hq, hkv, dim, batch,
                                  id=f"T{length}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-k{topk}"
                                     f"-h{hq}/{hkv}-D{dim}-B{batch}"))
    return cases


@pytest.mark.parametrize("length,dtype,causal,topk,hq,hkv,dim,batch", _accuracy_cases())
def test_sfa_attention_accuracy(length, dtype, causal, topk, hq, hkv, dim, batch):
    torch.manual_seed(length * 7 + dim + hq * 13 + hkv)
    topk = dim if topk == "D" else int(topk)
    q, k, v = make_qkv(batch, hq, hkv, length, length, dim, dtype)
    mask = position_mask(length, length, causal)
    q_sparse, k_sparse = oracle_sparsify(q, topk)[0], oracle_sparsify(k, topk)[0]
    ref, ref_lse = oracle_attention(q_sparse, k_sparse, v, mask)
    ours, lse = sfa_attention(q, k, v, topk=topk, causal=causal, return_lse=True)
    assert ours.dtype == dtype and ours.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert_flash_rule(ours, sdpa_low(q_sparse.to(dtype), k_sparse.to(dtype), v, mask), ref)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
def test_topk_d_is_dense(causal, hq, hkv):
    torch.manual_seed(3)
    q, k, v = make_qkv(2, hq, hkv, 63, 63, 64)
    rep = hq // hkv
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           is_causal=causal)
    torch.testing.assert_close(sfa_attention(q, k, v, topk=64, causal=causal), dense, rtol=1e-10, atol=1e-10)
    # Able to fail: dropping one coordinate per vector is no longer dense.
    assert (sfa_attention(q, k, v, topk=63, causal=causal) - dense).abs().max() > 1e-4


def test_scale_defaults_to_full_head_dim_and_can_be_set():
    torch.manual_seed(4)
    q, k, v = make_qkv(1, 4, 2, 63, 63, 64)
    mask = position_mask(63, 63, True)
    torch.testing.assert_close(sfa_attention(q, k, v, topk=8), oracle_sfa(q, k, v, 8, mask, scale=1 / 8)[0],
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sfa_attention(q, k, v, topk=8, scale=0.7), oracle_sfa(q, k, v, 8, mask, scale=0.7)[0],
                               rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------
# 3. Pairs with no shared coordinate score 0 (not -inf)
# ----------------------------------------------------------------------------------------------------------------

def disjoint_supports(batch, hq, hkv, length, dim):
    """q's large coordinates in the first half of D, k's in the second; the other halves are small but nonzero,
    so dense attention is far from uniform while the top-k (k <= D/2) supports never meet."""
    half = dim // 2

    def build(heads, big_first):
        big = (2 + torch.rand(batch, heads, length, half, dtype=F64)) * torch.randn(batch, heads, length, half).sign()
        small = 0.5 * torch.randn(batch, heads, length, half, dtype=F64).clamp(-1.9, 1.9)
        return torch.cat([big, small] if big_first else [small, big], dim=-1)
    return build(hq, True), build(hkv, False), torch.randn(batch, hkv, length, dim, dtype=F64)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("topk", [1, 8, 32])
def test_zero_overlap_pairs_score_zero(causal, topk):
    torch.manual_seed(5)
    length = 63
    q, k, v = disjoint_supports(2, 6, 2, length, 64)
    out, lse = sfa_attention(q, k, v, topk=topk, causal=causal, return_lse=True)
    keys = torch.arange(1, length + 1, dtype=F64) if causal else torch.full((length,), float(length), dtype=F64)
    torch.testing.assert_close(lse.to(F64), keys.log().expand(2, 6, length), rtol=1e-6, atol=1e-6)
    v_rep = v.repeat_interleave(3, 1)
    uniform = v_rep.cumsum(2) / keys[:, None] if causal else v_rep.mean(2, keepdim=True).expand_as(v_rep)
    torch.testing.assert_close(out, uniform, rtol=1e-10, atol=1e-10)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v_rep, is_causal=causal)
    assert (dense - uniform).abs().max() > 0.1  # the sparsification is what makes the weights uniform


def test_zero_overlap_keys_share_the_weight_exp_minus_lse():
    """With V one-hot per key the output row is the attention-weight row: keys whose support misses the query's
    all get weight exp(0 - lse) > 0, the keys that share coordinates get their own weights."""
    torch.manual_seed(6)
    length, dim, topk = 48, 64, 4
    q = torch.zeros(1, 2, length, dim, dtype=F64)
    k = torch.zeros(1, 1, length, dim, dtype=F64)
    q[..., :topk] = torch.randn(1, 2, length, topk, dtype=F64)
    shared = torch.arange(length) % 2 == 0  # even keys use q's coordinates, odd keys others
    k[:, :, shared, :topk] = torch.randn(1, 1, int(shared.sum()), topk, dtype=F64)
    k[:, :, ~shared, 32:32 + topk] = torch.randn(1, 1, int((~shared).sum()), topk, dtype=F64)
    v = torch.eye(length, dim, dtype=F64)[None, None]
    weights, lse = sfa_attention(q, k, v, topk=topk, causal=True, return_lse=True)
    weights = weights[..., :length]
    allowed = position_mask(length, length, True)[0]
    zero = allowed & ~shared[None, :]
    expected = torch.exp(-lse.to(F64))[..., None].expand_as(weights)
    torch.testing.assert_close(weights[..., zero], expected[..., zero], rtol=1e-6, atol=1e-12)
    assert (weights[..., zero] > 0).all() and (weights[..., ~allowed] == 0).all()
    overlapping = allowed & shared[None, :] & (torch.arange(length)[:, None] > 0)
    assert ((weights - expected).abs()[..., overlapping] > 1e-9).all()
    torch.testing.assert_close(weights, oracle_sfa(q, k, v, topk, allowed[None])[0][..., :length],
                               rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------
# 4. Gradients
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("hq,hkv,causal", [(4, 4, True), (6, 2, False), (4, 1, True)])
def test_gradients_match_dense_zero_filled_form(hq, hkv, causal, recompute, monkeypatch):
    """Autograd of the op equals autograd of the zero-filled form with a constant mask, on both blockwise paths
    (blocks stored, or recomputed in the backward pass); q and k get exactly 0 on unselected coordinates."""
    checkpoints = []
    real_checkpoint = blockwise_module.checkpoint
    monkeypatch.setattr(blockwise_module, "checkpoint",
                        lambda *a, **kw: checkpoints.append(1) or real_checkpoint(*a, **kw))
    if recompute:
        monkeypatch.setattr(blockwise_module, "_RECOMPUTE_ELEMENTS", 0)
    torch.manual_seed(7)
    tq, tk, dim, topk = 50, 63, 64, 8
    q, k, v = make_qkv(2, hq, hkv, tq, tk, dim, requires_grad=True)
    weight = torch.randn(2, hq, tq, dim, dtype=F64)
    grads = torch.autograd.grad((sfa_attention(q, k, v, topk=topk, causal=causal) * weight).sum(), (q, k, v))
    assert bool(checkpoints) == recompute
    (q_sparse, q_mask), (k_sparse, k_mask) = oracle_sparsify(q, topk), oracle_sparsify(k, topk)
    ref, _ = oracle_attention(q_sparse, k_sparse, v, position_mask(tq, tk, causal))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"gradient of {name}")
    assert torch.all(grads[0][~q_mask] == 0) and torch.all(grads[1][~k_mask] == 0)
    assert (grads[0][q_mask] != 0).float().mean() > 0.9 and (grads[1][k_mask] != 0).float().mean() > 0.5


# ----------------------------------------------------------------------------------------------------------------
# 5. GQA, decode, causality, output poisoned with NaN
# ----------------------------------------------------------------------------------------------------------------

def test_k_is_sparsified_once_per_kv_head(monkeypatch):
    shapes = []
    real_sparsify = reference_module.sparsify
    monkeypatch.setattr(reference_module, "sparsify", lambda x, topk: shapes.append(tuple(x.shape)) or
                        real_sparsify(x, topk))
    q, k, v = make_qkv(2, 6, 2, 9, 11, 16)
    sfa_attention(q, k, v, topk=4)
    assert sorted(shapes) == sorted([(2, 6, 9, 16), (2, 2, 11, 16)])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tk,tq", [(63, 1), (257, 7), (63, 63)])
def test_decode_matches_last_rows(causal, tk, tq):
    torch.manual_seed(tk + tq)
    q, k, v = make_qkv(2, 6, 2, tk, tk, 64)
    full = sfa_attention(q, k, v, topk=8, causal=causal)
    dec, lse = sfa_attention(q[:, :, -tq:], k, v, topk=8, causal=causal, return_lse=True)
    torch.testing.assert_close(dec, full[:, :, -tq:], rtol=1e-12, atol=1e-12)
    ref, ref_lse = oracle_sfa(q[:, :, -tq:], k, v, 8, position_mask(tq, tk, causal))
    torch.testing.assert_close(dec, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=1e-6, atol=1e-6)


def test_future_tokens_do_not_change_the_past():
    torch.manual_seed(8)
    length, cut = 63, 40
    q, k, v = make_qkv(1, 4, 2, length, length, 32)
    base = sfa_attention(q, k, v, topk=4)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, cut:] += 1.0
    k2[:, :, cut:] -= 2.0
    v2[:, :, cut:] *= 3.0
    moved = sfa_attention(q2, k2, v2, topk=4)
    assert torch.equal(moved[:, :, :cut], base[:, :, :cut])
    assert not torch.allclose(moved[:, :, cut:], base[:, :, cut:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
def test_out_poisoned_with_nan_and_fully_masked_row(dtype):
    torch.manual_seed(9)
    q, k, v = make_qkv(2, 4, 1, 63, 63, 64, dtype)
    padding = torch.rand(2, 1, 63, 63) < 0.8
    padding[1, 0, 17] = False  # query 17 of batch 1 attends nothing
    out = torch.full_like(q, float("nan"))
    got, lse = sfa_attention(q, k, v, topk=8, attn_mask=padding, out=out, return_lse=True)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[1, :, 17] == 0) and torch.all(lse[1, :, 17] == NEG_INF)
    mask = position_mask(63, 63, True)[:, None] & padding
    q_sparse, k_sparse = oracle_sparsify(q, 8)[0], oracle_sparsify(k, 8)[0]
    ref, _ = oracle_attention(q_sparse, k_sparse, v, mask)
    if dtype == F64:
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    else:
        assert_flash_rule(out, sdpa_low(q_sparse.to(dtype), k_sparse.to(dtype), v, mask[:, 0]), ref)


# ----------------------------------------------------------------------------------------------------------------
# 6. Public API and bad inputs
# ----------------------------------------------------------------------------------------------------------------

def test_exported():
    assert {"sfa_attention", "sparse_codes"} <= set(sa.__all__)
    assert sa.sfa_attention is sfa_attention and sa.sparse_codes is sparse_codes


B, HQ, HKV, T, D = 2, 4, 2, 11, 16
q0, k0, v0 = make_qkv(B, HQ, HKV, T, T, D, torch.float32)


def call(q=q0, k=k0, v=v0, **kwargs):
    return lambda: sfa_attention(q, k, v, **kwargs)


BAD_CALLS = {
    # name of the case: (call, argument names any one of which the message must name)
    "topk 0": (call(topk=0), ("topk",)),
    "topk D + 1": (call(topk=D + 1), ("topk",)),
    "topk 2.5": (call(topk=2.5), ("topk",)),
    "topk True": (call(topk=True), ("topk",)),
    "topk None": (call(topk=None), ("topk",)),
    "default topk 16 > D = 8": (call(*make_qkv(B, HQ, HKV, T, T, 8, torch.float32)), ("topk",)),
    "q not 4-d": (call(q=q0[0], topk=4), ("q",)),
    "k head dim differs": (call(k=k0[..., :8], v=v0[..., :8], topk=4), ("k", "q")),
    "Hq % Hkv != 0": (call(k=torch.randn(B, 3, T, D), v=torch.randn(B, 3, T, D), topk=4), ("k", "q")),
    "Tq > Tk": (call(k=k0[:, :, :-1], v=v0[:, :, :-1], topk=4), ("q", "k")),
    "k dtype differs": (call(k=k0.double(), topk=4), ("k",)),
    "v dtype differs": (call(v=v0.half(), topk=4), ("v",)),
    "NaN in k": (call(k=k0.clone().index_fill_(2, torch.tensor([3]), float("nan")), topk=4), ("k",)),
    "inf in q": (call(q=q0.clone().index_fill_(2, torch.tensor([3]), float("-inf")), topk=4), ("q",)),
    "causal a string": (call(topk=4, causal="yes"), ("causal",)),
    "return_lse a string": (call(topk=4, return_lse="no"), ("return_lse",)),
    "backend of: q a list": (lambda: sa.sfa_backend([1.0]), ("q",)),
    "backend of: q int": (lambda: sa.sfa_backend(torch.ones(2, 8, dtype=torch.long)), ("q",)),
    "backend of: q of head dim 0": (lambda: sa.sfa_backend(torch.ones(1, 1, 4, 0)), ("q",)),
    "backend of: attn_mask a string": (lambda: sa.sfa_backend(q0, attn_mask="x"), ("attn_mask",)),
    "backend of: attn_mask float": (lambda: sa.sfa_backend(q0, attn_mask=torch.ones(B, 1, T, T)), ("attn_mask",)),
    "backend of: return_lse None": (lambda: sa.sfa_backend(q0, return_lse=None), ("return_lse",)),
    "attn_mask on another device": (call(topk=4, attn_mask=torch.ones(B, 1, T, T, dtype=torch.bool, device="meta")),
                                    ("attn_mask",)),
    "backend unknown": (call(topk=4, backend="nope"), ("backend",)),
    "scale negative": (call(topk=4, scale=-1.0), ("scale",)),
    "scale inf": (call(topk=4, scale=float("inf")), ("scale",)),
    "softcap inf": (call(topk=4, softcap=float("inf")), ("softcap",)),
    "attn_mask float": (call(topk=4, attn_mask=torch.ones(B, 1, T, T)), ("attn_mask",)),
    "out wrong dtype": (call(topk=4, out=torch.empty(B, HQ, T, D, dtype=F64)), ("out",)),
    "codes: topk 0": (lambda: sparse_codes(q0, 0), ("topk",)),
    "codes: topk D + 1": (lambda: sparse_codes(q0, D + 1), ("topk",)),
    "codes: topk 2.5": (lambda: sparse_codes(q0, 2.5), ("topk",)),
    "codes: topk True": (lambda: sparse_codes(q0, True), ("topk",)),
    "codes: x int": (lambda: sparse_codes(torch.ones(3, 8, dtype=torch.long), 2), ("x",)),
    "codes: x a list": (lambda: sparse_codes([1.0, 2.0], 1), ("x",)),
    "codes: x 0-d": (lambda: sparse_codes(torch.tensor(1.0), 1), ("x",)),
    "codes: x of head dim 0": (lambda: sparse_codes(torch.ones(3, 0), 1), ("x",)),
    "sparsify: topk D + 1": (lambda: sparsify(q0, D + 1), ("topk",)),
    "densify: dim 0": (lambda: densify(*sparse_codes(q0, 2), 0), ("dim",)),
    "densify: shapes differ": (lambda: densify(sparse_codes(q0, 2)[0], sparse_codes(q0, 3)[1], D), ("indices",)),
    "densify: an index past dim": (lambda: densify(*sparse_codes(q0, 2), D // 2), ("indices",)),
    "densify: an index equal to dim": (lambda: densify(torch.tensor([D]), torch.ones(1), D), ("indices",)),
    "densify: a repeated index": (lambda: densify(torch.ones(2, dtype=torch.long), torch.ones(2), D), ("indices",)),
    "densify: float indices": (lambda: densify(torch.tensor([1.7, 0.2]), torch.ones(2), D), ("indices",)),
    "densify: a list of indices": (lambda: densify([1, 2], torch.ones(2), D), ("indices",)),
    "densify: 0-d codes": (lambda: densify(torch.tensor(1), torch.tensor(1.0), D), ("values",)),
    "densify: a negative index": (lambda: densify(-1 - sparse_codes(q0, 2)[0].long(), sparse_codes(q0, 2)[1], D),
                                  ("indices",)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_value_error_naming_it(case):
    bad_call, names = BAD_CALLS[case]
    with pytest.raises(ValueError) as info:
        bad_call()
    message = str(info.value)
    assert any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) for name in names), \
        f"{case}: message {message!r} names none of {names}"


@pytest.mark.parametrize("batch, expected", [(1, "[1, 1 or 4, 12, 12]"), (3, "[1 or 3, 1 or 4, 12, 12]")])
def test_a_mask_of_the_wrong_shape_is_told_the_shapes_that_broadcast(batch, expected):
    """A size of 1 was offered as "1 or 1"."""
    q = torch.randn(batch, 4, 12, 8)
    with pytest.raises(ValueError, match=re.escape(f"attn_mask: expected a bool tensor {expected}, got torch.bool "
                                                   "shape (1, 1, 12, 11)")):
        sa.sfa_attention(q, q, q, topk=2, attn_mask=torch.ones(1, 1, 12, 11, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("batch, q_heads", [(0, HQ), (B, 0)], ids=["no-batch", "no-query-heads"])
def test_empty_calls_with_a_padding_mask_return_empty_outputs(batch, q_heads, backend):
    """The reference reshaped the mask with an inferred head count, which no empty tensor has."""
    q, k, v = make_qkv(batch, q_heads, HKV, T, T, D, torch.float32)
    mask = torch.ones(batch, q_heads, T, T, dtype=torch.bool)
    assert sfa_attention(q, k, v, topk=3, attn_mask=mask, backend=backend).shape == q.shape


@pytest.mark.parametrize("kwargs", [{}, {"topk": 1, "backend": "reference"}, {"topk": D, "causal": False},
                                    {"topk": 3, "attn_mask": torch.ones(1, HQ, T, T, dtype=torch.bool)}])
def test_good_inputs_do_not_raise(kwargs):
    out = sfa_attention(q0, k0, v0, **kwargs)
    assert out.shape == q0.shape and torch.isfinite(out).all()
