"""SFA through PyTorch's dense attention: ``sfa_attention(backend="sdpa")``.

The zero-filled sparse q~ and k~ are ordinary dense tensors whose dot products are exactly SFA's logits (a sum over
the shared coordinates, zero-overlap pairs scoring 0), so ``F.scaled_dot_product_attention(q~, k~, v)`` computes SFA
with whichever dense kernel PyTorch picks (cuDNN or FlashAttention on GPUs). It runs at dense tensor-core speed and
saves nothing from the sparsity: it is the fastest SFA where dense attention runs on tensor cores, and the yardstick
the sparse FlashSFA kernels must beat there; ``backend="auto"`` takes it on CUDA for every call it can compute (the
H200 timings: :mod:`.attention`). Memory: q~ and k~ are one more copy of q and k, O(T x D); no T x T tensor unless
the call brings one (``attn_mask``): a causal chunk with Tq < Tk passes PyTorch's lower-right causal bias, which its
flash and memory-efficient kernels apply without a mask tensor.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..._checks import fail
from ..masked_sdpa import causal_mask, masked_sdpa, unmasked_sdpa
from .codes import sparsify


NO_SOFTCAP = "PyTorch's scaled_dot_product_attention has no logit softcap"
NO_LSE = "PyTorch's scaled_dot_product_attention does not return the log-sum-exp"


def sdpa_blocker(softcap: Optional[float], return_lse: bool) -> Optional[str]:
    """Why the sdpa backend cannot compute a call with these arguments, or None when it can (any device, dtype,
    head dim and padding mask)."""
    if softcap is not None:
        return NO_SOFTCAP
    return NO_LSE if return_lse else None


def check_sdpa_call(softcap: Optional[float], return_lse: bool) -> None:
    """ValueError for what the sdpa backend cannot compute (:func:`sdpa_blocker`), naming the argument."""
    if softcap is not None:
        fail("softcap", f"None with backend 'sdpa' ({NO_SOFTCAP})", softcap)
    if return_lse:
        fail("return_lse", f"False with backend 'sdpa' ({NO_LSE})", return_lse)


def sfa_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, topk: int, causal: bool, scale: float,
                       attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SFA of checked inputs (q [B, Hq, Tq, D], k, v [B, Hkv, Tk, D], attn_mask bool [1|B, 1|Hq, Tq, Tk] or None) as
    :func:`sieve_attn.sfa_attention` defines it; returns out [B, Hq, Tq, D] in q's dtype.

    Query i sits at key position Tk - Tq + i. A query with no attended key (possible only through ``attn_mask``)
    gets 0, with zero gradients (:func:`..masked_sdpa.masked_sdpa`). Gradients reach q and k at their kept
    coordinates only (``sparsify``'s straight-through rule) and v everywhere.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    q_sparse, k_sparse = sparsify(q, topk), sparsify(k, topk)
    if attn_mask is not None:
        allowed = attn_mask & causal_mask(q_len, k_len, q.device) if causal else attn_mask
        return masked_sdpa(q_sparse, k_sparse, v, allowed, scale=scale)
    return unmasked_sdpa(q_sparse, k_sparse, v, causal=causal, scale=scale)
