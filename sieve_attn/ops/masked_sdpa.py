"""PyTorch's dense attention under a boolean mask, for the paths that hand a pattern to SDPA: Focus's ``dense``
backend (short sequences) and SFA's ``sdpa`` backend with a padding mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
