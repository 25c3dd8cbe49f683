"""merge_indexed: the Triton kernel (the interpreter on the CPU) and its PyTorch reference against the log-sum-exp
merge computed directly in float64."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops import merge

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = ["reference", "triton"]


def _partials(batch, heads, length, dim, parts, inner, dtype, seed, token_major):
    """(out [B, H, T, D], lse [B, H, T], part_out [A, H, I, D], part_lse [A, H, I], index [B * T]): lse -inf in some
    rows of both partials (out 0 there, as the kernels leave empty rows), index -1 in others."""
    gen = torch.Generator().manual_seed(seed)
    if token_major:  # the window kernel's float32 partial: [B, T, H, D] in memory
        out = torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2)
    else:
        out = torch.randn(batch, heads, length, dim, generator=gen)
    lse = torch.randn(batch, heads, length, generator=gen) * 3
    part_out = torch.randn(parts, inner, heads, dim, generator=gen).transpose(1, 2)  # cuDNN's layout
    part_lse = torch.randn(parts, heads, inner, generator=gen) * 3
    lse[:, :, ::4] = float("-inf")
    out[:, :, ::4] = 0.0
    part_lse[:, :, 1::3] = float("-inf")
    part_out[:, :, 1::3] = 0.0
    index = torch.randint(0, parts * inner, (batch * length,), generator=gen)
    index[::5] = -1
    return out.to(DEVICE, dtype), lse.to(DEVICE), part_out.to(DEVICE, dtype), part_lse.to(DEVICE), index.to(DEVICE)


def _expected(out, lse, part_out, part_lse, index):
    """The merge row by row in float64."""
    batch, heads, length, dim = out.shape
    want_out = torch.zeros(batch, heads, length, dim, dtype=torch.float64)
    want_lse = torch.full((batch, heads, length), float("-inf"), dtype=torch.float64)
    part_rows = part_out.double().cpu().transpose(1, 2).reshape(-1, heads, dim)
    part_stats = part_lse.double().cpu().transpose(1, 2).reshape(-1, heads)
    for n in range(batch * length):
        b, t = divmod(n, length)
        lses, outs = [lse[b, :, t].double().cpu()], [out[b, :, t].double().cpu()]
        if index[n] >= 0:
            lses.append(part_stats[index[n]])
            outs.append(part_rows[index[n]])
        stacked = torch.stack(lses)  # [parts, H]
        total = torch.logsumexp(stacked, 0)
        weights = torch.where(torch.isfinite(total), torch.exp(stacked - total), 0.0).nan_to_num(0.0)
        want_out[b, :, t] = (weights[..., None] * torch.stack(outs)).sum(0)
        want_lse[b, :, t] = total
    return want_out, want_lse


def _run(variant, *args, result=None):
    if variant == "triton":
        pytest.importorskip("triton")
        return merge.merge_indexed_triton(*args, result)
    return merge.merge_indexed_reference(*args, result)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("batch, heads, length, dim, parts, inner, dtype, token_major", [
    (1, 2, 37, 16, 5, 9, torch.float32, True),      # packed segments, odd length, token-major partial
    (2, 3, 20, 24, 40, 1, torch.float32, False),    # rows of extra copies ([E, H, 1, D]), D not a power of two
    (1, 1, 70, 64, 3, 30, torch.bfloat16, False),   # several programs per head
    (2, 2, 9, 128, 2, 11, torch.float16, True),
])
def test_matches_float64_merge(variant, batch, heads, length, dim, parts, inner, dtype, token_major):
    args = _partials(batch, heads, length, dim, parts, inner, dtype, seed=length, token_major=token_major)
    # NaN-poisoned result buffers: every row must be written
    result = (torch.full(args[0].shape, float("nan"), dtype=dtype, device=DEVICE),
              torch.full(args[1].shape, float("nan"), device=DEVICE))
    got_out, got_lse = _run(variant, *args, result=result)
    assert got_out is result[0] and got_lse is result[1]
    want_out, want_lse = _expected(*args)
    assert torch.equal(torch.isinf(got_lse.cpu()), torch.isinf(want_lse)) and not got_out.isnan().any()
    finite = torch.isfinite(want_lse)
    assert (got_lse.cpu().double()[finite] - want_lse[finite]).abs().max() < 1e-5
    tolerance = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # one rounding of the result
    assert (got_out.cpu().double() - want_out).abs().max() <= tolerance * max(1.0, want_out.abs().max())
    assert torch.equal(got_out.cpu()[~finite[..., None].expand_as(got_out)],
                       torch.zeros_like(got_out.cpu())[~finite[..., None].expand_as(got_out)])


@pytest.mark.parametrize("variant", VARIANTS)
def test_merges_in_place(variant):
    out, lse, part_out, part_lse, index = _partials(2, 2, 19, 32, 4, 7, torch.float32, seed=3, token_major=False)
    want_out, want_lse = _expected(out, lse, part_out, part_lse, index)
    got_out, got_lse = _run(variant, out, lse, part_out, part_lse, index, result=(out, lse))
    assert got_out is out and got_lse is lse
    assert (out.cpu().double() - want_out).abs().max() < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_new_result_takes_the_partials_dtype(variant):
    args = _partials(1, 2, 8, 16, 2, 4, torch.bfloat16, seed=5, token_major=True)
    got_out, got_lse = _run(variant, *args)
    assert got_out.dtype == torch.bfloat16 and got_out.is_contiguous() and got_lse.dtype == torch.float32


def test_merge_partials_subtracts_sets_counted_twice():
    """Keys split into A and B overlapping in C: the partials of A and B merged with C's subtracted equal the
    softmax over A | B computed directly, in float64; a row whose keys are all in C keeps them."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 2, 12, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 2, 12, 4, generator=gen, dtype=torch.float64)
    in_a = torch.zeros(5, 12, dtype=torch.bool)
    in_b = torch.zeros(5, 12, dtype=torch.bool)
    in_a[:, :8], in_b[:, 5:] = True, True
    in_a[4], in_b[4] = True, True  # row 4: A = B = C, every key
    both = in_a & in_b

    def partial(keys):
        s = scores.masked_fill(~keys[:, None], float("-inf"))
        return torch.einsum("nhk,nhkd->nhd", torch.softmax(s, -1), values), torch.logsumexp(s, -1)

    (out_a, lse_a), (out_b, lse_b), (out_c, lse_c) = partial(in_a), partial(in_b), partial(both)
    index = torch.arange(5).repeat(3)
    subtracted = torch.arange(15) >= 10
    out, lse = merge.merge_partials(None, torch.cat([out_a, out_b, out_c]), torch.cat([lse_a, lse_b, lse_c]), index,
                                    5, torch.float64, subtracted)
    want_out, want_lse = partial(in_a | in_b)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merges_several_parts_and_subtracts_one(variant, dtype):
    """Two part rows per query from one layout (index [N, 2], some -1) and one subtracted row from another, the
    part values scaled by part_unit: against the formula in float64 (weights of the subtracted rows negative)."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, length, dim, unit = 2, 3, 23, 40, 2.0 ** -5
    out, lse, part_out, part_lse, _ = _partials(batch, heads, length, dim, 6, 10, dtype, seed=11, token_major=True)
    count = batch * length
    index = torch.randint(0, 60, (count, 2), generator=gen)
    index[::3, 1] = -1
    index[1::7] = -1  # rows with no part (some of them with an empty base too: all empty)
    sub_out = torch.randn(4, 9, heads, dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # cuDNN's layout
    # One subtracted row per query that has a first part, each row owned by one query. A subtracted set lies inside
    # the others: its weight stays below the first part's.
    owners = (index[:, 0] >= 0).nonzero()[:36, 0]
    sub_index = torch.full((count,), -1, dtype=torch.long)
    sub_index[owners] = torch.randperm(36, generator=gen)[:owners.numel()]
    first_lse = part_lse.cpu().transpose(1, 2).reshape(-1, heads)[index[owners, 0]]
    sub_rows = torch.full((36, heads), float("-inf"))
    sub_rows[sub_index[owners]] = first_lse - 0.7
    sub_lse = sub_rows.view(4, 9, heads).transpose(1, 2).to(DEVICE)
    index, sub_index = index.to(DEVICE), sub_index.to(DEVICE)
    has = sub_index >= 0
    result = (torch.full(out.shape, float("nan"), dtype=dtype, device=DEVICE),
              torch.full(lse.shape, float("nan"), device=DEVICE))
    run = merge.merge_indexed_triton if variant == "triton" else merge.merge_indexed_reference
    if variant == "triton":
        pytest.importorskip("triton")
    got_out, got_lse = run(out, lse, part_out, part_lse, index, result, subtracted=(sub_out, sub_lse, sub_index),
                           part_unit=unit)

    rows = lambda o, l, i: (o.double().cpu().transpose(1, 2).reshape(-1, heads, dim)[i.clamp_min(0).cpu()],
                            l.double().cpu().transpose(1, 2).reshape(-1, heads)[i.clamp_min(0).cpu()]
                            .masked_fill((i < 0).cpu()[..., None], float("-inf")))
    base_out = out.double().cpu().transpose(1, 2).reshape(count, heads, dim)
    base_lse = lse.double().cpu().transpose(1, 2).reshape(count, heads)
    p_out, p_lse = rows(part_out, part_lse, index)  # [N, 2, H, D], [N, 2, H]
    u_out, u_lse = rows(sub_out, sub_lse, sub_index)
    weights = torch.cat([base_lse[:, None], p_lse, u_lse[:, None]], 1).exp()  # [N, 4, H]
    weights[:, 3] *= -1
    values = torch.cat([base_out[:, None], p_out * unit, u_out[:, None] * unit], 1)
    total = weights.sum(1)
    want_out = torch.where(total[..., None] > 0, (weights[..., None] * values.nan_to_num(0.0)).sum(1)
                           / total.clamp_min(1e-300)[..., None], 0.0)
    want_lse = torch.where(total > 0, total.clamp_min(1e-300).log(), float("-inf"))
    got_out = got_out.double().cpu().transpose(1, 2).reshape(count, heads, dim)
    got_lse = got_lse.double().cpu().transpose(1, 2).reshape(count, heads)
    assert bool((total == 0).any()) and bool(has.any())  # both kinds of rows are exercised
    assert bool(torch.isfinite(u_lse).sum() > 10 * heads)  # and subtracted rows that weigh
    plain = run(out, lse, part_out, part_lse, index, part_unit=unit)[0].double().cpu().transpose(1, 2)
    assert (plain.reshape(count, heads, dim) - want_out).abs().max() > 1e-2  # the subtraction changes the result
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse)) and not got_out.isnan().any()
    finite = torch.isfinite(want_lse)
    assert (got_lse[finite] - want_lse[finite]).abs().max() < 1e-5
    tolerance = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert (got_out - want_out).abs().max() <= tolerance * max(1.0, want_out.abs().max())
