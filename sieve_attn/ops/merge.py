"""Log-sum-exp merge of partial attention results over disjoint key sets.

If a query's keys split into disjoint sets with partial results (o_s, lse_s) (each o_s normalised over its own set),
the result over the union is lse = logsumexp_s(lse_s) and o = sum_s exp(lse_s - lse) o_s. An empty set has
lse_s = -inf and weight 0; a query whose sets are all empty gets o = 0 and lse = -inf (the FlashAttention convention).
"""
from __future__ import annotations

import torch


def merge_extra_partials(out: torch.Tensor, lse: torch.Tensor, extra_out: torch.Tensor, extra_lse: torch.Tensor,
                         batch_index: torch.Tensor, token_index: torch.Tensor) -> None:
    """Merges extra partials into ``out`` and ``lse`` in place.

    out [B, H, T, D] and lse [B, H, T] (float32) hold one partial per query; extra_out [E, H, D] and extra_lse
    [E, H] (float32) hold E more, the e-th for query token ``token_index[e]`` of sequence ``batch_index[e]`` (a token
    may receive several). Rows no extra partial points at are left untouched.
    """
    if extra_out.shape[0] == 0:
        return
    rows = batch_index.long() * out.shape[2] + token_index.long()
    unique, inverse = torch.unique(rows, return_inverse=True)
    b, t = unique // out.shape[2], unique % out.shape[2]
    base_lse = lse[b, :, t]                      # [U, H]
    base_out = out[b, :, t, :].float()           # [U, H, D]
    top = base_lse.scatter_reduce(0, inverse[:, None].expand_as(extra_lse), extra_lse, "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    base_weight = torch.exp(base_lse - top)
    extra_weight = torch.exp(extra_lse - top[inverse])
    total = base_weight.index_add(0, inverse, extra_weight)
    merged = (base_weight[..., None] * base_out).index_add(0, inverse, extra_weight[..., None] * extra_out)
    merged = torch.where(total[..., None] > 0, merged / total.clamp_min(1e-30)[..., None], torch.zeros_like(merged))
    out[b, :, t, :] = merged.to(out.dtype)
    lse[b, :, t] = torch.where(total > 0, top + torch.log(total.clamp_min(1e-30)), torch.full_like(top, -torch.inf))
