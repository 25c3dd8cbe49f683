"""Log-sum-exp merge of partial attention results over disjoint key sets.

If a query's keys split into disjoint sets with partial results (o_s, lse_s) (each o_s normalised over its own set),
the result over the union is lse = logsumexp_s(lse_s) and o = sum_s exp(lse_s - lse) o_s. An empty set has
lse_s = -inf and weight 0; a query whose sets are all empty gets o = 0 and lse = -inf (the FlashAttention convention).

:func:`merge_partials` is the merge (functional, differentiable); :func:`merge_extra_partials` applies it in place to
rows of a [B, H, T, D] result; :func:`merge_indexed` merges a few more partials into each row (one of them possibly
subtracted), by one Triton kernel on CUDA. None synchronises with the host.
"""
from __future__ import annotations

from typing import Optional

import torch

from .triton_common import jit, triton

if triton is not None:
    import triton.language as tl


def merge_partials(base: Optional[tuple[torch.Tensor, torch.Tensor]], out_rows: torch.Tensor,
                   lse_rows: torch.Tensor, index: torch.Tensor, count: int,
                   dtype: torch.dtype = torch.float32,
                   subtracted: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges partials by row: partial e (out_rows [E, H, D], lse_rows [E, H]) belongs to row ``index[e]`` (int64
    [E], values in [0, N), N = ``count``; a row may own several or none). ``base`` = (out [N, H, D], lse [N, H]) holds
    one more partial for each row, or is None.

    ``subtracted`` (bool [E], optional) marks partials whose key sets are to be taken away rather than added
    (inclusion-exclusion): each must lie inside the union of its row's other sets, which then count those keys
    twice. Their weights enter the sums negatively, so the result is over the union once.

    Returns (out [N, H, D], lse [N, H]), computed and returned in ``dtype`` (float32 by default; pass float64 for
    float64 partials).
    A fully masked row (all its partials have lse -inf, or it has none) gets out 0 and lse -inf, without NaN in the
    values or the gradients. Differentiable in every partial's out and lse; the shift that keeps exp() in range is
    held constant (the result does not depend on it).
    """
    out_rows, lse_rows = out_rows.to(dtype), lse_rows.to(dtype)
    heads = lse_rows.shape[1]
    spread = index[:, None].expand(-1, heads)
    if base is None:
        top = lse_rows.new_full((count, heads), float("-inf")).scatter_reduce_(0, spread, lse_rows, "amax")
    else:
        base_out, base_lse = base[0].to(dtype), base[1].to(dtype)
        top = base_lse.scatter_reduce(0, spread, lse_rows, "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weight = torch.exp(lse_rows - top[index])
    if subtracted is not None:
        weight = torch.where(subtracted[:, None], -weight, weight)
    if base is None:
        total = top.new_zeros(count, heads).index_add_(0, index, weight)
        out = out_rows.new_zeros(count, heads, out_rows.shape[2])
    else:
        base_weight = torch.exp(base_lse - top)
        total = base_weight.index_add(0, index, weight)  # out of place: exp's backward needs base_weight
        out = base_weight[..., None] * base_out
    out = out.index_add_(0, index, weight[..., None] * out_rows)
    # total is 0 (no finite partial) or >= 1 (the largest partial has weight 1; a subtracted set takes away only
    # keys counted twice).
    filled = total > 0
    safe_total = torch.where(filled, total, 1.0)
    out = torch.where(filled[..., None], out / safe_total[..., None], 0.0)
    lse = torch.where(filled, top + torch.log(safe_total), float("-inf"))
    return out, lse


def merge_extra_partials(out: torch.Tensor, lse: torch.Tensor, extra_out: torch.Tensor, extra_lse: torch.Tensor,
                         batch_index: torch.Tensor, token_index: torch.Tensor, one_per_row: bool = False) -> None:
    """Merges extra partials into ``out`` and ``lse`` in place.

    out [B, H, T, D] (any float dtype) and lse [B, H, T] (float32) hold one partial per query; extra_out [E, H, D]
    and extra_lse [E, H] (float32) hold E more, the e-th for query token ``token_index[e]`` of sequence
    ``batch_index[e]`` (a token may receive several). A row whose partials all have lse -inf gets out 0 and lse
    -inf.

    With ``one_per_row`` (no token receives two), one :func:`merge_indexed` pass over all rows (one kernel on
    CUDA): rows without an extra are rewritten too, unchanged where their lse is finite, as 0 where it is -inf.
    Otherwise :func:`merge_partials` in float32 merges all partials of a row at once, reading and writing only the E
    rows pointed at.
    """
    extras = extra_out.shape[0]
    if extras == 0:
        return
    batch_index, token_index = batch_index.long(), token_index.long()
    if one_per_row:
        index = torch.full((out.shape[0] * out.shape[2],), -1, dtype=torch.long, device=out.device)
        index[batch_index * out.shape[2] + token_index] = torch.arange(extras, device=out.device)
        merge_indexed(out, lse, extra_out[:, :, None], extra_lse[:, :, None], index, result=(out, lse))
        return
    # Row of each extra = its row's first extra (a host-sync-free torch.unique): merged there, then copied back to
    # every extra of the row (equal values, so duplicate writes agree).
    rows = batch_index * out.shape[2] + token_index
    first = rows.new_full((out.shape[0] * out.shape[2],), extras)
    first = first.scatter_reduce_(0, rows, torch.arange(extras, device=rows.device), "amin")[rows]
    base = out[batch_index, :, token_index, :], lse[batch_index, :, token_index]  # [E, H, D], [E, H]
    merged_out, merged_lse = merge_partials(base, extra_out, extra_lse, first, extras)
    out[batch_index, :, token_index, :] = merged_out[first].to(out.dtype)
    lse[batch_index, :, token_index] = merged_lse[first].to(lse.dtype)


def merge_indexed(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                  index: torch.Tensor, result: Optional[tuple[torch.Tensor, torch.Tensor]] = None, *,
                  subtracted: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                  part_unit: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges further partials into each query's: ``out`` [B, H, T, D] and ``lse`` [B, H, T] (float32) hold one
    partial per query; ``part_out`` [A, H, I, D] and ``part_lse`` [A, H, I] hold others, and query row n = b * T + t
    takes the part rows ``index[n]`` (int64 [B * T], or [B * T, m] for m of them, each = a * I + i; -1 = none). Any
    strides.

    ``subtracted`` = (sub_out [A', H, I', D], sub_lse [A', H, I'], sub_index [B * T]) gives each query one more part
    row (or none, -1) whose keys its other partials count twice (inclusion-exclusion): its weight enters the sums
    negatively, so the result is over the union once (:func:`merge_partials`' ``subtracted``). ``part_unit``
    multiplies the values of the part and subtracted rows (a power of two, e.g. undoing the scale of a fused call's
    value copy, is exact).

    The result goes to ``result`` = (out [B, H, T, D], lse [B, H, T], float32 or, for float64 partials, float64),
    which may be ``out`` and ``lse`` themselves (each row is read before it is written), or to new contiguous
    tensors of ``out``'s dtype (lse float32). The sums are float32 (float64 for float64 partials). A row whose
    partials are all empty (lse -inf) gets out 0 and lse -inf. No autograd (the decomposition and the Triton backend
    handle gradients themselves). On CUDA :func:`merge_indexed_triton`, one kernel that reads each row once, except
    for float64 partials; elsewhere :func:`merge_indexed_reference`. Returns the result.
    """
    on_gpu = triton is not None and out.device.type == "cuda" and out.dtype != torch.float64
    merge = merge_indexed_triton if on_gpu else merge_indexed_reference
    return merge(out, lse, part_out, part_lse, index, result, subtracted=subtracted, part_unit=part_unit)


def _result_of(out, lse, result):
    if result is not None:
        return result
    return (torch.empty(out.shape, dtype=out.dtype, device=out.device),
            torch.empty(lse.shape, dtype=torch.float32, device=out.device))


def _indexed_rows(part_out, part_lse, index, heads, dim):
    """Rows of [A, H, I, D] and [A, H, I] partials at ``index`` (any shape): ([*index, H, D], [*index, H]), lse -inf
    where the index is -1 (such a row takes any part row at weight 0)."""
    taken = index.clamp_min(0)
    rows = part_out.transpose(1, 2).reshape(-1, heads, dim)[taken]
    rows_lse = part_lse.transpose(1, 2).reshape(-1, heads)[taken].masked_fill((index < 0)[..., None], float("-inf"))
    return rows, rows_lse


def merge_indexed_reference(out, lse, part_out, part_lse, index, result=None, *, subtracted=None, part_unit=1.0):
    """:func:`merge_indexed` by :func:`merge_partials`."""
    result = _result_of(out, lse, result)
    batch, heads, length, dim = out.shape
    count = batch * length
    dtype = torch.promote_types(out.dtype, torch.float32)
    rows_out = out.transpose(1, 2).reshape(count, heads, dim)
    rows_lse = lse.transpose(1, 2).reshape(count, heads)
    columns = index.view(count, -1)
    parts = [_indexed_rows(part_out, part_lse, columns, heads, dim)]
    if subtracted is not None:
        parts.append(_indexed_rows(subtracted[0], subtracted[1], subtracted[2].view(count, 1), heads, dim))
    flat_out = torch.cat([p[0].flatten(0, 1).to(dtype) for p in parts]) * part_unit
    flat_lse = torch.cat([p[1].flatten(0, 1) for p in parts])
    owner = torch.cat([torch.arange(count, device=out.device).repeat_interleave(p[1].shape[1]) for p in parts])
    minus = None
    if subtracted is not None:
        minus = torch.arange(owner.numel(), device=out.device) >= parts[0][1].shape[0] * parts[0][1].shape[1]
    merged, merged_lse = merge_partials((rows_out, rows_lse), flat_out, flat_lse, owner, count, dtype, minus)
    result[0].copy_(merged.view(batch, length, heads, dim).transpose(1, 2))
    result[1].copy_(merged_lse.view(batch, length, heads).transpose(1, 2))
    return result


def merge_indexed_triton(out, lse, part_out, part_lse, index, result=None, *, subtracted=None, part_unit=1.0):
    """:func:`merge_indexed` by the Triton kernel (CUDA, or the interpreter)."""
    result_out, result_lse = _result_of(out, lse, result)
    batch, heads, length, dim = out.shape
    count = batch * length
    out, part_out = (t if t.stride(-1) == 1 else t.contiguous() for t in (out, part_out))
    columns = index.reshape(count, -1).contiguous()
    if subtracted is None:  # the kernel reads nothing of it: any tensors of the right dtypes serve
        sub_out, sub_lse, sub_index = part_out, part_lse, columns
    else:
        sub_out, sub_lse, sub_index = subtracted
        sub_out = sub_out if sub_out.stride(-1) == 1 else sub_out.contiguous()
        sub_index = sub_index.reshape(count).contiguous()
    # the kernel stores features unit-stride
    target = result_out if result_out.stride(-1) == 1 else torch.empty(result_out.shape, dtype=result_out.dtype,
                                                                       device=result_out.device)
    _merge_indexed_kernel[(triton.cdiv(count, _MERGE_ROWS), heads)](
        out, lse, part_out, part_lse, columns, sub_out, sub_lse, sub_index, target, result_lse, count, length,
        part_out.shape[2], sub_out.shape[2], float(part_unit),
        *out.stride()[:3], *lse.stride(), *part_out.stride()[:3], *part_lse.stride(), *sub_out.stride()[:3],
        *sub_lse.stride(), *target.stride()[:3], *result_lse.stride(), dim,
        PARTS=columns.shape[1], SUBTRACT=subtracted is not None, ROWS=_MERGE_ROWS,
        BLOCK_D=triton.next_power_of_2(dim), num_warps=_MERGE_WARPS)
    if target is not result_out:
        result_out.copy_(target)
    return result_out, result_lse


# Query rows per program of the merge kernel (one head each), and its warps: the fastest plan of the v13 probe at
# 64K tokens, 8 heads (benchmarks/results/focus_h200/NOTES.md), within 5% of the best for one and for three parts.
_MERGE_ROWS, _MERGE_WARPS = 16, 2


@jit
def _indexed_lse(PL, INDEX, n, j, live, head, part_inner, s_qa, s_qh, s_qi, columns: tl.constexpr):
    """(lse, a, i) of part row INDEX[n, j] of rows n, with lse -inf where the index is -1 or the row is not live."""
    p = tl.load(INDEX + n * columns + j, mask=live, other=-1).to(tl.int64)
    a, i = tl.maximum(p, 0) // part_inner, tl.maximum(p, 0) % part_inner
    lse = tl.load(PL + a * s_qa + head * s_qh + i * s_qi, mask=live & (p >= 0), other=float("-inf"))
    return lse.to(tl.float32), a, i


@jit
def _weighted_rows(BASE, rows, weight, live, d, cols):
    """[ROWS, BLOCK_D] float32: ``weight`` [ROWS] times the rows at BASE + rows (element offsets). A row of weight 0
    is not read, so whatever an empty row holds cannot turn into NaN."""
    values = tl.load(BASE + rows[:, None] + d[None, :], mask=(live & (weight > 0))[:, None] & cols, other=0.0)
    return weight[:, None] * values.to(tl.float32)


@jit
def _merge_indexed_kernel(O, L, PO, PL, INDEX, SO, SL, SINDEX, RO, RL, count, length, part_inner, sub_inner,
                          part_unit, s_ob, s_oh, s_ot, s_lb, s_lh, s_lt, s_pa, s_ph, s_pi, s_qa, s_qh, s_qi,
                          s_ua, s_uh, s_ui, s_va, s_vh, s_vi, s_rb, s_rh, s_rt, s_sb, s_sh, s_st, dim,
                          PARTS: tl.constexpr, SUBTRACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    head = tl.program_id(1).to(tl.int64)
    n = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live = n < count
    b, t = n // length, n % length
    d = tl.arange(0, BLOCK_D)
    cols = (d < dim)[None, :]
    lse_o = tl.load(L + b * s_lb + head * s_lh + t * s_lt, mask=live, other=float("-inf"))
    # a subtracted set lies inside the others, so its lse never exceeds theirs: the maximum skips it
    top = lse_o
    for j in tl.static_range(PARTS):
        lse_p, a, i = _indexed_lse(PL, INDEX, n, j, live, head, part_inner, s_qa, s_qh, s_qi, PARTS)
        top = tl.maximum(top, lse_p)
    top = tl.where(top == float("-inf"), 0.0, top)  # all empty: weights 0, no -inf - -inf
    w_o = tl.exp(lse_o - top)
    total = w_o
    merged = _weighted_rows(O, b * s_ob + head * s_oh + t * s_ot, w_o, live, d, cols)
    for j in tl.static_range(PARTS):
        lse_p, a, i = _indexed_lse(PL, INDEX, n, j, live, head, part_inner, s_qa, s_qh, s_qi, PARTS)
        w_p = tl.exp(lse_p - top)
        total += w_p
        merged += part_unit * _weighted_rows(PO, a * s_pa + head * s_ph + i * s_pi, w_p, live, d, cols)
    if SUBTRACT:
        lse_u, a, i = _indexed_lse(SL, SINDEX, n, 0, live, head, sub_inner, s_va, s_vh, s_vi, 1)
        w_u = tl.exp(lse_u - top)
        total -= w_u
        merged -= part_unit * _weighted_rows(SO, a * s_ua + head * s_uh + i * s_ui, w_u, live, d, cols)
    # total is 0 (no finite partial) or >= 1 (the largest partial has weight 1; a subtracted set takes away only
    # keys counted twice)
    filled = total > 0
    safe = tl.where(filled, total, 1.0)
    tl.store(RO + (b * s_rb + head * s_rh + t * s_rt)[:, None] + d[None, :],
             (merged / safe[:, None]).to(RO.dtype.element_ty), mask=live[:, None] & cols)
    tl.store(RL + b * s_sb + head * s_sh + t * s_st, tl.where(filled, top + tl.log(safe), float("-inf")), mask=live)
