"""PyTorch's dense attention, for the paths that hand a pattern to SDPA: under a boolean mask (Focus's ``dense``
backend for short sequences, SFA's ``sdpa`` backend with a padding mask), or causal without a mask tensor (SFA's
``sdpa`` backend, the dense target of SFA's output-matching term)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def causal_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """bool [Tq, Tk]: query i sits at key position Tk - Tq + i and attends the keys at or before it."""
    positions = torch.arange(k_len, device=device)
    return positions[None, :] <= positions[k_len - q_len:, None]


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *,
                scale: float) -> torch.Tensor:
    """SDPA of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D] (query head h reads KV head h // (Hq // Hkv)) where
    ``allowed`` (bool, broadcastable to [B, Hq, Tq, Tk]) is True; out [B, Hq, Tq, D] in q's dtype. A query with no
    allowed key gets 0 with zero gradients: it attends every key inside the kernel and the result is dropped (dense
    kernels differ on fully masked rows, some giving NaN)."""
    attended = allowed.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~attended, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return torch.where(attended, out, 0.0)


def unmasked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float) -> torch.Tensor:
    """SDPA of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D] (GQA as in :func:`masked_sdpa`) with no mask tensor, so
    PyTorch's fused kernels can take it in O(T) memory; out [B, Hq, Tq, D] in q's dtype. Causal: query i sits at key
    position Tk - Tq + i (``is_causal`` when Tq == Tk, PyTorch's lower-right causal bias for Tq < Tk)."""
    q_len, k_len = q.shape[2], k.shape[2]
    bias = causal_lower_right(q_len, k_len) if causal and q_len < k_len else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal and bias is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
