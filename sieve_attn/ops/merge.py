"""Log-sum-exp merge of partial attention results over disjoint key sets.

If a query's keys split into disjoint sets with partial results (o_s, lse_s) (each o_s normalised over its own set),
the result over the union is lse = logsumexp_s(lse_s) and o = sum_s exp(lse_s - lse) o_s. An empty set has
lse_s = -inf and weight 0; a query whose sets are all empty gets o = 0 and lse = -inf (the FlashAttention convention).

:func:`merge_partials` is the merge (functional, differentiable); :func:`merge_extra_partials` applies it in place to
rows of a [B, H, T, D] result. Neither synchronises with the host.
"""
from __future__ import annotations

from typing import Optional

import torch


def merge_partials(base: Optional[tuple[torch.Tensor, torch.Tensor]], out_rows: torch.Tensor,
                   lse_rows: torch.Tensor, index: torch.Tensor, count: int,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges partials by row: partial e (out_rows [E, H, D], lse_rows [E, H]) belongs to row ``index[e]`` (int64
    [E], values in [0, N), N = ``count``; a row may own several or none). ``base`` = (out [N, H, D], lse [N, H]) holds
    one more partial for each row, or is None.

    Returns (out [N, H, D], lse [N, H]), computed and returned in ``dtype`` (float32, or float64 for float64 inputs).
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
    if base is None:
        total = top.new_zeros(count, heads).index_add_(0, index, weight)
        out = out_rows.new_zeros(count, heads, out_rows.shape[2])
    else:
        base_weight = torch.exp(base_lse - top)
        total = base_weight.index_add(0, index, weight)  # out of place: exp's backward needs base_weight
        out = base_weight[..., None] * base_out
    out = out.index_add_(0, index, weight[..., None] * out_rows)
    # total is 0 (no finite partial) or >= 1 (the largest partial has weight 1).
    filled = total > 0
    safe_total = torch.where(filled, total, 1.0)
    out = torch.where(filled[..., None], out / safe_total[..., None], 0.0)
    lse = torch.where(filled, top + torch.log(safe_total), float("-inf"))
    return out, lse


def merge_extra_partials(out: torch.Tensor, lse: torch.Tensor, extra_out: torch.Tensor, extra_lse: torch.Tensor,
                         batch_index: torch.Tensor, token_index: torch.Tensor) -> None:
    """Merges extra partials into ``out`` and ``lse`` in place, by :func:`merge_partials` in float32.

    out [B, H, T, D] (any float dtype) and lse [B, H, T] (float32) hold one partial per query; extra_out [E, H, D]
    and extra_lse [E, H] (float32) hold E more, the e-th for query token ``token_index[e]`` of sequence
    ``batch_index[e]`` (a token may receive several). Rows no extra partial points at are left untouched; a row whose
    partials all have lse -inf gets out 0 and lse -inf. Only the E rows pointed at are read and written.
    """
    extras = extra_out.shape[0]
    if extras == 0:
        return
    batch_index, token_index = batch_index.long(), token_index.long()
    # Row of each extra = its row's first extra (a host-sync-free torch.unique): merged there, then copied back to
    # every extra of the row (equal values, so duplicate writes agree).
    rows = batch_index * out.shape[2] + token_index
    first = rows.new_full((out.shape[0] * out.shape[2],), extras)
    first = first.scatter_reduce_(0, rows, torch.arange(extras, device=rows.device), "amin")[rows]
    base = out[batch_index, :, token_index, :], lse[batch_index, :, token_index]  # [E, H, D], [E, H]
    merged_out, merged_lse = merge_partials(base, extra_out, extra_lse, first, extras)
    out[batch_index, :, token_index, :] = merged_out[first].to(out.dtype)
    lse[batch_index, :, token_index] = merged_lse[first].to(lse.dtype)
