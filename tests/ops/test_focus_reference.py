"""Focus attention (hard and soft) against an independent fp64 oracle.

The oracle below is written from DESIGN.md alone: it builds the whole Tq x Tk boolean mask by broadcasting,
repeats K/V per query head with repeat_interleave, and takes a plain softmax in float64. Nothing in it is imported
from sieve_attn.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import sieve_attn.ops.blockwise as blockwise_module
from sieve_attn import focus_attention, focus_soft_attention
from sieve_attn.ops.blockwise import blockwise_attention
from sieve_attn.ops.focus.reference import focus_pair_mask

F64 = torch.float64
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------------------
# Independent oracle
# ----------------------------------------------------------------------------------------------------------------

def random_groups(batch, length, num_groups, slots=None):
    """[B, T] ids in [0, num_groups), or [B, T, slots] distinct ids per token with some -1 slots (>= 1 real id)."""
    if slots is None:
        return torch.randint(0, num_groups, (batch, length))
    ids = torch.rand(batch, length, num_groups).argsort(dim=-1)[..., :slots]
    empty = torch.rand(batch, length, slots) < 0.4
    empty[..., 0] = False
    ids = ids.masked_fill(empty, -1)
    perm = torch.rand(batch, length, slots).argsort(dim=-1)  # move the guaranteed id to a random slot
    return ids.gather(-1, perm)


def oracle_mask(groups, window, causal, q_len=None):
    """bool [B, Tq, Tk]: (j <= i if causal) and (0 <= i - j <= window or i, j share a non-negative group id).

    Query row r sits at key position Tk - Tq + r.
    """
    g = groups if groups.dim() == 3 else groups[..., None]
    batch, k_len, _ = g.shape
    q_len = k_len if q_len is None else q_len
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    local = ((i - j) >= 0) & ((i - j) <= window)
    num_groups = int(g.max()) + 1
    member = torch.zeros(batch, k_len, num_groups + 1, dtype=F64)  # column num_groups collects the -1 slots
    member.scatter_(2, torch.where(g >= 0, g, num_groups), 1.0)
    member = member[..., :num_groups]
    share = (member[:, k_len - q_len:] @ member.transpose(1, 2)) > 0  # [B, Tq, Tk]: some group in common
    mask = local[None] | share
    if causal:
        mask = mask & (j <= i)[None]
    return mask


def loop_mask(groups, window, causal):
    """The same definition with plain Python loops (used to validate oracle_mask on small cases)."""
    g = groups if groups.dim() == 3 else groups[..., None]
    batch, length, _ = g.shape
    mask = torch.zeros(batch, length, length, dtype=torch.bool)
    for b in range(batch):
        sets = [set(int(x) for x in g[b, t] if int(x) >= 0) for t in range(length)]
        for i in range(length):
            for j in range(length):
                if causal and j > i:
                    continue
                if 0 <= i - j <= window or sets[i] & sets[j]:
                    mask[b, i, j] = True
    return mask


def causal_only_mask(q_len, k_len):
    i = torch.arange(k_len - q_len, k_len)[:, None]
    return (torch.arange(k_len)[None, :] <= i)[None]


def oracle_attention(q, k, v, mask, *, scale=None, softcap=None, score_fn=None):
    """fp64 softmax attention. mask: bool broadcastable to [B, Hq, Tq, Tk] ([B, Tq, Tk] is taken as per batch).

    Returns (out [B, Hq, Tq, D] float64, lse [B, Hq, Tq] float64); fully masked rows give 0 and -inf.
    Differentiable (inputs that are already float64 keep their autograd history).
    """
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if score_fn is not None:
        s = score_fn(s)
    if mask.dim() == 3:
        mask = mask[:, None]
    mask = mask.expand_as(s)
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    has = mask.any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(has, s, torch.zeros_like(s)), dim=-1) * has
    return p @ v, lse


def low_precision_torch(q, k, v, mask, scale=None):
    """PyTorch's own computation in the inputs' dtype: SDPA with the same boolean mask."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask[:, None], scale=scale)


def make_qkv(batch, hq, hkv, tq, tk, dim, dtype=F64, requires_grad=False, std=1.0):
    q = (torch.randn(batch, hq, tq, dim, dtype=F64) * std).to(dtype)
    k = (torch.randn(batch, hkv, tk, dim, dtype=F64) * std).to(dtype)
    v = torch.randn(batch, hkv, tk, dim, dtype=F64).to(dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def assert_flash_rule(ours, torch_low, ref, slack=1e-5):
    err = (ours.to(F64) - ref).abs().max().item()
    base = (torch_low.to(F64) - ref).abs().max().item()
    assert err <= 2 * base + slack, f"error {err:.3e} > 2 x PyTorch's {base:.3e} + {slack}"


# ----------------------------------------------------------------------------------------------------------------
# The oracle itself
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("slots", [None, 3])
def test_oracle_mask_matches_loops(causal, slots):
    torch.manual_seed(1)
    groups = random_groups(2, 23, 6, slots)
    for window in (0, 2, 30):
        assert torch.equal(oracle_mask(groups, window, causal), loop_mask(groups, window, causal))


# ----------------------------------------------------------------------------------------------------------------
# 1. Accuracy on odd shapes (the FlashAttention rule) and decode
# ----------------------------------------------------------------------------------------------------------------

HEADS = [(4, 4), (6, 2), (4, 1), (4, 2)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _accuracy_cases():
    cases = []
    combos = itertools.product([1, 63, 257], DTYPES, [True, False], ["0", "5", "T+3"])
    for idx, (length, dtype, causal, window) in enumerate(combos):
        # idx % 16 enumerates heads x groups form x D, so each T (18 consecutive cases) sees every combination.
        hq, hkv = HEADS[idx % 4]
        slots = (None, 3)[(idx // 4) % 2]
        dim = (64, 128)[(idx // 8) % 2]
        batch = 1 if length > 100 else 2
        cases.append(pytest.param(length, dtype, causal, window, hq, hkv, dim, slots, batch,
                                  id=f"T{length}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-w{window}"
                                     f"-h{hq}/{hkv}-D{dim}-{'m3' if slots else '2d'}-B{batch}"))
    return cases


@pytest.mark.parametrize("length,dtype,causal,window,hq,hkv,dim,slots,batch", _accuracy_cases())
def test_focus_attention_accuracy(length, dtype, causal, window, hq, hkv, dim, slots, batch):
    torch.manual_seed(length * 7 + dim + hq * 13 + hkv)
    window = {"0": 0, "5": 5, "T+3": length + 3}[window]
    q, k, v = make_qkv(batch, hq, hkv, length, length, dim, dtype)
    groups = random_groups(batch, length, 8 if slots else 5, slots)
    mask = oracle_mask(groups, window, causal)
    ref, _ = oracle_attention(q, k, v, mask)
    ours = focus_attention(q, k, v, groups, window=window, causal=causal)
    assert ours.dtype == dtype and ours.shape == q.shape
    assert_flash_rule(ours, low_precision_torch(q, k, v, mask), ref)


@pytest.mark.parametrize("offset", [0, 61, 10_000])
def test_group_ids_of_any_size(offset):
    """Ids up to 62 take the bit-set path, larger ones the per-slot comparison: both must give the pattern."""
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 4, 2, 63, 63, 64)
    groups = random_groups(2, 63, 6, 3)
    groups = torch.where(groups >= 0, groups + offset, groups)
    ref, _ = oracle_attention(q, k, v, oracle_mask(groups, 3, True))
    torch.testing.assert_close(focus_attention(q, k, v, groups, window=3), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("slots", [None, 3])
@pytest.mark.parametrize("tk,tq", [(63, 1), (257, 7), (63, 63)])
def test_decode_matches_last_rows(causal, slots, tk, tq):
    torch.manual_seed(tk + tq)
    q, k, v = make_qkv(2, 6, 2, tk, tk, 64)
    groups = random_groups(2, tk, 7, slots)
    full = focus_attention(q, k, v, groups, window=4, causal=causal)
    dec, lse = focus_attention(q[:, :, -tq:], k, v, groups, window=4, causal=causal, return_lse=True)
    torch.testing.assert_close(dec, full[:, :, -tq:], rtol=1e-12, atol=1e-12)
    ref, ref_lse = oracle_attention(q[:, :, -tq:], k, v, oracle_mask(groups, 4, causal, q_len=tq))
    torch.testing.assert_close(dec, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_future_tokens_do_not_change_the_past(causal):
    torch.manual_seed(3)
    length, cut = 63, 40
    q, k, v = make_qkv(1, 4, 2, length, length, 16)
    groups = random_groups(1, length, 6, 2)
    base = focus_attention(q, k, v, groups, window=3, causal=True)
    q2, k2, v2, g2 = q.clone(), k.clone(), v.clone(), groups.clone()
    q2[:, :, cut:] += 1.0
    k2[:, :, cut:] -= 2.0
    v2[:, :, cut:] *= 3.0
    g2[:, cut:] = random_groups(1, length - cut, 6, 2)
    moved = focus_attention(q2, k2, v2, g2, window=3, causal=True)
    assert torch.equal(moved[:, :, :cut], base[:, :, :cut])
    assert not torch.allclose(moved[:, :, cut:], base[:, :, cut:])


# ----------------------------------------------------------------------------------------------------------------
# 2. Output poisoned with NaN before the op runs
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
def test_out_poisoned_with_nan_public(dtype):
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 4, 1, 63, 63, 64, dtype)
    groups = random_groups(2, 63, 6, 3)
    out = torch.full_like(q, float("nan"))
    got = focus_attention(q, k, v, groups, window=5, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    assert torch.equal(got, out)
    mask = oracle_mask(groups, 5, True)
    ref, _ = oracle_attention(q, k, v, mask)
    if dtype == F64:
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    else:
        assert_flash_rule(out, low_precision_torch(q, k, v, mask), ref)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq", [63, 40])
def test_out_poisoned_with_nan_small_blocks(causal, tq):
    torch.manual_seed(6)
    tk = 63
    q, k, v = make_qkv(2, 6, 2, tq, tk, 32)
    groups = random_groups(2, tk, 6, 3)
    padding = torch.rand(2, 1, tq, tk) < 0.8
    padding[1, 0, 17] = False  # a fully masked row inside the second query block
    out = torch.full_like(q, float("nan"))
    got, lse = blockwise_attention(q, k, v, scale=0.3, causal=causal, pair_mask=focus_pair_mask(groups, 5),
                                   attn_mask=padding, block_size=16, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref, ref_lse = oracle_attention(q, k, v, oracle_mask(groups, 5, causal, q_len=tq)[:, None] & padding, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    assert torch.all(out[1, :, 17] == 0) and torch.all(lse[1, :, 17] == NEG_INF)


# ----------------------------------------------------------------------------------------------------------------
# 3. Log-sum-exp
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("causal", [True, False])
def test_return_lse(dtype, causal):
    torch.manual_seed(7)
    q, k, v = make_qkv(2, 4, 2, 63, 63, 64, dtype)
    groups = random_groups(2, 63, 5)
    out, lse = focus_attention(q, k, v, groups, window=5, causal=causal, scale=0.2, return_lse=True)
    assert lse.shape == (2, 4, 63) and lse.dtype == torch.float32
    mask = oracle_mask(groups, 5, causal)
    ref, ref_lse = oracle_attention(q, k, v, mask, scale=0.2)
    # Independently: logsumexp of the masked, scaled scores.
    scores = q.to(F64) @ k.to(F64).repeat_interleave(2, 1).transpose(-1, -2) * 0.2
    direct = torch.logsumexp(scores.masked_fill(~mask[:, None], NEG_INF), dim=-1)
    torch.testing.assert_close(ref_lse, direct)
    torch.testing.assert_close(lse.to(F64), direct, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out.to(F64), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# 4. Degenerate equivalences with dense attention, softcap
# ----------------------------------------------------------------------------------------------------------------

def dense_sdpa(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=causal)


@pytest.mark.parametrize("offset", [-1, 0, 5])
@pytest.mark.parametrize("slots", [None, 3])
def test_large_window_is_dense_causal(offset, slots):
    torch.manual_seed(8)
    length = 63
    q, k, v = make_qkv(2, 4, 2, length, length, 32)
    groups = random_groups(2, length, 16, slots)
    ours = focus_attention(q, k, v, groups, window=length + offset, causal=True)
    torch.testing.assert_close(ours, dense_sdpa(q, k, v, True), rtol=1e-10, atol=1e-10)


def test_window_just_below_dense_is_not_dense():
    # Makes the test above able to fail: each token alone in its group and window T-2 drop pair (T-1, 0).
    torch.manual_seed(9)
    length = 63
    q, k, v = make_qkv(1, 2, 2, length, length, 16)
    groups = torch.arange(length)[None]
    ours = focus_attention(q, k, v, groups, window=length - 2, causal=True)
    dense = dense_sdpa(q, k, v, True)
    torch.testing.assert_close(ours[:, :, :-1], dense[:, :, :-1], rtol=1e-10, atol=1e-10)
    assert (ours[:, :, -1] - dense[:, :, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["2d", "3d-with-empty-slot"])
def test_single_group_is_dense(causal, form):
    torch.manual_seed(10)
    length = 63
    q, k, v = make_qkv(2, 4, 1, length, length, 32)
    groups = torch.zeros(2, length, dtype=torch.long)
    if form != "2d":
        groups = torch.stack([groups + 3, torch.full_like(groups, -1)], dim=-1)
    ours = focus_attention(q, k, v, groups, window=0, causal=causal)
    torch.testing.assert_close(ours, dense_sdpa(q, k, v, causal), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_top_k_equal_num_groups_is_dense(causal):
    torch.manual_seed(11)
    length, num_groups = 63, 5
    q, k, v = make_qkv(2, 6, 2, length, length, 32)
    groups = torch.rand(2, length, num_groups).argsort(dim=-1)  # every token lists every group, in any order
    ours = focus_attention(q, k, v, groups, window=0, causal=causal)
    torch.testing.assert_close(ours, dense_sdpa(q, k, v, causal), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("causal", [True, False])
def test_softcap(dtype, causal):
    torch.manual_seed(12)
    q, k, v = make_qkv(2, 4, 2, 63, 63, 32, dtype, std=1.5)
    groups = random_groups(2, 63, 6, 2)
    mask = oracle_mask(groups, 3, causal)
    out, lse = focus_attention(q, k, v, groups, window=3, causal=causal, scale=1.0, softcap=4.0, return_lse=True)
    ref, ref_lse = oracle_attention(q, k, v, mask, scale=1.0, softcap=4.0)
    plain, _ = oracle_attention(q, k, v, mask, scale=1.0)
    assert (ref - plain).abs().max() > 0.1  # the cap really bites at this scale
    tol = 1e-10 if dtype == F64 else 2e-5
    torch.testing.assert_close(out.to(F64), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------------------------------------------------
# 5. Gradients
# ----------------------------------------------------------------------------------------------------------------

def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.fixture(params=["stored", "recomputed"])
def block_path(request, monkeypatch):
    """Runs a test on both autograd paths of blockwise_attention: every block stored, and every block recomputed in
    the backward pass through torch.utils.checkpoint (which the package picks only when B*Hq*Tq*Tk exceeds
    ``_RECOMPUTE_ELEMENTS``; the threshold is lowered to 0 here so tiny shapes take that path).

    Yields the list of checkpoint calls seen, so a test can assert the recomputed path really ran.
    """
    calls = []
    real_checkpoint = blockwise_module.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(blockwise_module, "checkpoint", spy)
    if request.param == "recomputed":
        monkeypatch.setattr(blockwise_module, "_RECOMPUTE_ELEMENTS", 0)
    yield request.param, calls


def _check_path(block_path, blocks):
    mode, calls = block_path
    if mode == "recomputed":
        assert len(calls) >= blocks, f"checkpoint ran {len(calls)} times for {blocks} blocks"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq", [63, 50])
def test_gradients_small_blocks(causal, tq, block_path):
    torch.manual_seed(13)
    tk = 63
    q, k, v = make_qkv(2, 4, 2, tq, tk, 16, requires_grad=True)
    groups = random_groups(2, tk, 6, 3)
    go = torch.randn(2, 4, tq, 16, dtype=F64)
    gl = torch.randn(2, 4, tq, dtype=F64)
    out, lse = blockwise_attention(q, k, v, scale=0.25, causal=causal, pair_mask=focus_pair_mask(groups, 5),
                                   block_size=16)
    _check_path(block_path, math.ceil(tq / 16))
    ours = _grads((out * go).sum() + (lse * gl).sum(), (q, k, v))
    ref, ref_lse = oracle_attention(q, k, v, oracle_mask(groups, 5, causal, q_len=tq), scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    expected = _grads((ref * go).sum() + (ref_lse * gl).sum(), (q, k, v))
    for name, a, b in zip("qkv", ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
def test_gradients_public(hq, hkv):
    torch.manual_seed(14)
    q, k, v = make_qkv(1, hq, hkv, 57, 57, 16, requires_grad=True)
    groups = random_groups(1, 57, 4)
    go = torch.randn(1, hq, 57, 16, dtype=F64)
    ours = _grads((focus_attention(q, k, v, groups, window=2, softcap=3.0) * go).sum(), (q, k, v))
    ref, _ = oracle_attention(q, k, v, oracle_mask(groups, 2, True), softcap=3.0)
    expected = _grads((ref * go).sum(), (q, k, v))
    for name, a, b in zip("qkv", ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_gradcheck_blockwise_tiny(block_path):
    torch.manual_seed(15)
    q, k, v = make_qkv(1, 2, 1, 9, 9, 4, requires_grad=True)
    groups = random_groups(1, 9, 4, 2)
    pair_mask = focus_pair_mask(groups, 1)

    def fn(q, k, v):
        out, lse = blockwise_attention(q, k, v, scale=0.5, causal=True, pair_mask=pair_mask, block_size=4)
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5)
    _check_path(block_path, 3)


def test_gradcheck_public_tiny():
    torch.manual_seed(16)
    q, k, v = make_qkv(1, 2, 2, 7, 7, 4, requires_grad=True)
    groups = random_groups(1, 7, 3)
    # (lse is returned in float32 by contract, too coarse for finite differences; blockwise's gradcheck covers it)
    assert torch.autograd.gradcheck(
        lambda q, k, v: focus_attention(q, k, v, groups, window=1, causal=False, softcap=2.0),
        (q, k, v), eps=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# 6. Soft gating
# ----------------------------------------------------------------------------------------------------------------

def soft_score_fn(assign, window, gate, gate_lambda, q_len):
    a = assign.to(F64)
    k_len = a.shape[1]
    affinity = a[:, k_len - q_len:] @ a.transpose(1, 2)  # [B, Tq, Tk]
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    local = (((i - j) >= 0) & ((i - j) <= window)).to(F64)[None]
    if gate == "log":
        mod = (1 - local) * torch.log(affinity + 1e-6)
        return lambda s: s + mod[:, None]
    factor = local + (1 - local) * torch.sigmoid(gate_lambda * affinity)
    return lambda s: s * factor[:, None]


@pytest.mark.parametrize("gate", ["log", "multiplicative"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq", [37, 20])
def test_soft_attention_matches_oracle_with_grads(gate, causal, tq):
    torch.manual_seed(17)
    tk, num_groups = 37, 4
    q, k, v = make_qkv(2, 4, 2, tq, tk, 16, requires_grad=True)
    assign = torch.softmax(torch.randn(2, tk, num_groups, dtype=F64) * 2, dim=-1).requires_grad_(True)
    softcap = 5.0 if gate == "log" else None
    out, lse = focus_soft_attention(q, k, v, assign, window=3, gate=gate, causal=causal, gate_lambda=7.0,
                                    softcap=softcap, return_lse=True)
    mask = causal_only_mask(tq, tk) if causal else torch.ones(1, tq, tk, dtype=torch.bool)
    ref, ref_lse = oracle_attention(q, k, v, mask, softcap=softcap,
                                    score_fn=soft_score_fn(assign, 3, gate, 7.0, tq))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=2e-6, atol=2e-6)
    go = torch.randn_like(ref)
    ours = _grads((out * go).sum(), (q, k, v, assign))
    expected = _grads((ref * go).sum(), (q, k, v, assign))
    assert ours[3].abs().max() > 0  # gradients reach the router's memberships
    for name, a, b in zip(("q", "k", "v", "assign"), ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_soft_log_gate_with_one_hot_assign_is_close_to_hard():
    torch.manual_seed(18)
    length, num_groups = 63, 4
    q, k, v = make_qkv(2, 4, 2, length, length, 16)
    groups = random_groups(2, length, num_groups)
    assign = F.one_hot(groups, num_groups).to(F64)
    soft = focus_soft_attention(q, k, v, assign, window=3, gate="log")
    hard = focus_attention(q, k, v, groups, window=3)
    dense = dense_sdpa(q, k, v, True)
    assert (hard - dense).abs().max() > 0.05  # the pattern really is sparse here
    torch.testing.assert_close(soft, hard, rtol=0, atol=2e-3)


# ----------------------------------------------------------------------------------------------------------------
# 7. attn_mask (padding)
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_heads", ["1", "Hq", "batch1"])
@pytest.mark.parametrize("tq", [40, 23])
def test_attn_mask_is_anded(mask_heads, tq, block_path):
    torch.manual_seed(19)
    tk, batch, hq, hkv = 40, 2, 6, 2
    q, k, v = make_qkv(batch, hq, hkv, tq, tk, 16, requires_grad=True)
    groups = random_groups(batch, tk, 5, 2)
    shape = {"1": (batch, 1), "Hq": (batch, hq), "batch1": (1, 1)}[mask_heads]
    padding = torch.rand(*shape, tq, tk) < 0.7
    padding[0, -1, 5] = False  # fully masked row
    out = torch.full_like(q, float("nan")).detach()
    got, lse = focus_attention(q, k, v, groups, window=4, attn_mask=padding, return_lse=True, out=out)
    _check_path(block_path, 1)
    ref, ref_lse = oracle_attention(q, k, v, oracle_mask(groups, 4, True, q_len=tq)[:, None] & padding)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=2e-6, atol=2e-6)
    heads = slice(None) if shape[1] == 1 else hq - 1
    assert torch.all(got[0, heads, 5] == 0) and torch.all(lse[0, heads, 5] == NEG_INF)
    go = torch.randn_like(ref)
    ours = _grads((got * go).sum(), (q, k, v))
    expected = _grads((ref * go).sum(), (q, k, v))
    for name, a, b in zip("qkv", ours, expected):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("gate", ["log", "multiplicative"])
def test_attn_mask_soft(gate):
    torch.manual_seed(20)
    length = 31
    q, k, v = make_qkv(2, 4, 4, length, length, 16)
    assign = torch.softmax(torch.randn(2, length, 3, dtype=F64), dim=-1)
    padding = torch.rand(2, 1, length, length) < 0.7
    padding[1, 0, 9] = False
    out, lse = focus_soft_attention(q, k, v, assign, window=2, gate=gate, attn_mask=padding, return_lse=True)
    ref, ref_lse = oracle_attention(q, k, v, causal_only_mask(length, length)[:, None] & padding,
                                    score_fn=soft_score_fn(assign, 2, gate, 10.0, length))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=2e-6, atol=2e-6)
    assert torch.all(out[1, :, 9] == 0) and torch.all(lse[1, :, 9] == NEG_INF)


@pytest.mark.parametrize("gate", ["log", "multiplicative"])
def test_soft_gradients_small_blocks(gate, block_path):
    # Several blocks, and (block_path "recomputed") a checkpointed score_mod that closes over `assign`, which is
    # not an input of the checkpointed function: its gradient must still arrive.
    from sieve_attn.ops.focus.reference import soft_gate_score_mod

    torch.manual_seed(21)
    length = 41
    q, k, v = make_qkv(1, 4, 2, length, length, 8, requires_grad=True)
    assign = torch.softmax(torch.randn(1, length, 3, dtype=F64), dim=-1).requires_grad_(True)
    out, lse = blockwise_attention(q, k, v, scale=0.4, causal=True, block_size=16,
                                   score_mod=soft_gate_score_mod(assign, 2, gate, 4.0))
    _check_path(block_path, 3)
    ref, ref_lse = oracle_attention(q, k, v, causal_only_mask(length, length), scale=0.4,
                                    score_fn=soft_score_fn(assign, 2, gate, 4.0, length))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    go, gl = torch.randn_like(ref), torch.randn_like(ref_lse)
    ours = _grads((out * go).sum() + (lse * gl).sum(), (q, k, v, assign))
    expected = _grads((ref * go).sum() + (ref_lse * gl).sum(), (q, k, v, assign))
    for name, a, b in zip(("q", "k", "v", "assign"), ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("gate", ["log", "multiplicative"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask_heads", [None, "1", "Hq"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("need", ["qkv", "assign only"])
def test_soft_pair_gate_equals_score_mod(gate, causal, mask_heads, softcap, need):
    """The pair gate (hand-written backward, what focus_soft_attention runs) against the score_mod form of the same
    gate (autograd): identical forward, gradients equal to rounding, lse gradients included, several blocks, a
    fully masked row, GQA, sink rows of ones, and (``need``) a frozen model's q, k, v with only the memberships
    needing gradients."""
    from sieve_attn.ops.focus.reference import soft_gate_pair_gate, soft_gate_score_mod

    torch.manual_seed(22)
    batch, hq, hkv, tq, tk = 2, 6, 2, 29, 33
    q, k, v = make_qkv(batch, hq, hkv, tq, tk, 8, requires_grad=need == "qkv")
    assign = torch.softmax(torch.randn(batch, tk, 3, dtype=F64) * 2, dim=-1)
    assign[:, 0] = 1.0
    assign.requires_grad_(True)
    padding = None
    if mask_heads is not None:
        padding = torch.rand(batch, 1 if mask_heads == "1" else hq, tq, tk) < 0.7
        padding[0, -1, 5] = False  # fully masked row (in head 0 at least)
    kw = dict(scale=0.4, causal=causal, softcap=softcap, attn_mask=padding, block_size=8)
    ref, ref_lse = blockwise_attention(q, k, v, score_mod=soft_gate_score_mod(assign, 3, gate, 4.0), **kw)
    out, lse = blockwise_attention(q, k, v, pair_gate=soft_gate_pair_gate(3, gate, 4.0), gate_inputs=(assign,),
                                   **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    go = torch.randn_like(ref)
    gl = torch.randn_like(ref_lse)
    inputs = (q, k, v, assign) if need == "qkv" else (assign,)

    def loss(o, lse_):
        return (o * go).sum() + (torch.where(torch.isfinite(lse_), lse_, 0) * gl).sum()
    ours = _grads(loss(out, lse), inputs)
    expected = _grads(loss(ref, ref_lse), inputs)
    assert ours[-1].abs().max() > 0
    for a, b in zip(ours, expected):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_soft_pair_gate_low_precision_gradients_accumulate_in_float32():
    """bfloat16 q, k, v: the gradients of several blocks add up in float32 before the one cast to bfloat16, so they
    stay within bfloat16 rounding of the float64 result."""
    from sieve_attn.ops.focus.reference import soft_gate_pair_gate

    torch.manual_seed(23)
    q, k, v = make_qkv(1, 4, 2, 96, 96, 16)
    assign = torch.softmax(torch.randn(1, 96, 4, dtype=F64) * 2, dim=-1)
    go = torch.randn(1, 4, 96, 16, dtype=F64)
    results = []
    for dtype in (F64, torch.bfloat16):
        leaves = [t.to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        a = assign.to(torch.promote_types(dtype, torch.float32)).clone().requires_grad_(True)
        out, _ = blockwise_attention(*leaves, scale=0.25, causal=True, block_size=8,
                                     pair_gate=soft_gate_pair_gate(4, "log", 10.0), gate_inputs=(a,))
        assert out.dtype == dtype
        grads = _grads((out.to(F64) * go).sum(), (*leaves, a))
        assert all(g.dtype == t.dtype for g, t in zip(grads, (*leaves, a)))
        results.append([out, *grads])
    for ours, ref in zip(results[1], results[0]):
        assert (ours.to(F64) - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_block_size_is_larger_off_the_cpu():
    from sieve_attn.ops.blockwise import query_block_size

    assert query_block_size(2, 9, 4096) == 56
    assert query_block_size(2, 9, 4096, torch.device("cpu")) == 56
    assert query_block_size(2, 9, 4096, torch.device("cuda")) == 910
    assert query_block_size(1, 9, 1024, torch.device("cuda")) == 1024


# ----------------------------------------------------------------------------------------------------------------
# Layout and range
# ----------------------------------------------------------------------------------------------------------------

def test_non_contiguous_inputs():
    # transformers hands over q, k, v as [B, T, H, D].transpose(1, 2).
    torch.manual_seed(22)
    length = 37
    q = torch.randn(2, length, 6, 16, dtype=F64).transpose(1, 2)
    k = torch.randn(2, length, 2, 16, dtype=F64).transpose(1, 2)
    v = torch.randn(2, length, 2, 16, dtype=F64).transpose(1, 2)
    groups = random_groups(2, length, 4, 2)
    ours = focus_attention(q, k, v, groups, window=3)
    ref, _ = oracle_attention(q, k, v, oracle_mask(groups, 3, True))
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_large_logits_are_stable(dtype):
    torch.manual_seed(23)
    length = 63
    q, k, v = make_qkv(1, 2, 2, length, length, 16, dtype, std=6.0)  # logits in the hundreds
    groups = random_groups(1, length, 4)
    out, lse = focus_attention(q, k, v, groups, window=2, causal=False, return_lse=True)
    mask = oracle_mask(groups, 2, False)
    ref, ref_lse = oracle_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_flash_rule(out, low_precision_torch(q, k, v, mask), ref)
    torch.testing.assert_close(lse.to(F64), ref_lse, rtol=1e-5, atol=1e-4)


def test_pair_gate_and_score_mod_are_refused_together():
    from sieve_attn.ops.focus.reference import soft_gate_pair_gate, soft_gate_score_mod

    q = torch.randn(1, 2, 6, 8)
    assign = torch.softmax(torch.randn(1, 6, 3), dim=-1)
    with pytest.raises(ValueError, match="pair_gate: expected None when score_mod is given"):
        blockwise_attention(q, q, q, scale=0.3, causal=True, pair_gate=soft_gate_pair_gate(2, "log", 4.0),
                            gate_inputs=(assign,),
                            score_mod=soft_gate_score_mod(assign, 2, "log", 4.0))
