"""Plain-PyTorch attention computed one block of queries at a time.

This is the single reference mechanism behind every attention op of the package: an op describes its pattern as a
``pair_mask`` (which pairs attend) and optionally a ``score_mod`` (how a pair's logit is changed), the way
FlexAttention's mask_mod and score_mod do. Memory is O(block * Tk) per head, never Tq x Tk, and under autograd, long
sequences recompute each block in the backward pass instead of storing it.

Conventions (shared by every op built on it):
- q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D], Hq % Hkv == 0; query head h reads KV head h // (Hq // Hkv), the
  ``repeat_interleave`` convention of transformers' ``repeat_kv``. K and V are never copied per query head.
- Queries are aligned to the end of the keys: query i sits at key position ``Tk - Tq + i`` (a KV cache holds the
  first ``Tk - Tq`` positions). Causal means key position <= query position.
- Logits are ``scale * q.k`` (then ``softcap * tanh(logit / softcap)`` when softcap is set), computed in float32 or
  wider, then ``score_mod``, then masking.
- A query with no attended key (fully masked row) returns output 0 and log-sum-exp -inf, as FlashAttention does.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

PairMask = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Elements of one block's score tensor: 2**22 float32 values is 16 MiB, small next to a model yet large enough that
# the Python loop over blocks costs little.
_BLOCK_ELEMENTS = 2 ** 22
# Under autograd, blocks are recomputed in the backward pass (instead of stored) only when the whole score tensor
# would exceed this many elements (512 MiB in float32); below it, storing is cheaper than recomputing.
_RECOMPUTE_ELEMENTS = 2 ** 27


def query_block_size(batch: int, heads: int, keys: int) -> int:
    rows = _BLOCK_ELEMENTS // max(1, batch * heads * keys)
    return max(16, min(1024, rows))


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    pair_mask: Optional[PairMask] = None,
    score_mod: Optional[ScoreMod] = None,
    softcap: Optional[float] = None,
    attn_mask: Optional[torch.Tensor] = None,
    block_size: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the pairs allowed by ``causal``, ``pair_mask`` and ``attn_mask`` (all must allow a pair).

    pair_mask(q_pos [bq], k_pos [bk]) -> bool [B or 1, bq, bk]: True where the pair may attend (shared by heads).
    score_mod(scores [B, Hkv, G, bq, bk], q_pos, k_pos) -> scores of the same shape (float32 or wider).
    attn_mask: bool [B or 1, 1 or Hq, Tq, Tk], True = may attend (transformers' boolean mask convention).

    out: optional [B, Hq, Tq, D] tensor of q's dtype; every query block is written into it in place.

    Returns ``out`` [B, Hq, Tq, D] in q's dtype and ``lse`` [B, Hq, Tq] (natural log, float32 or wider).
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    offset = k_len - q_len
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(batch, kv_heads, group, q_len, head_dim)
    if attn_mask is not None:
        attn_mask = attn_mask.reshape(attn_mask.shape[0], -1, 1, q_len, k_len)
        if attn_mask.shape[1] == q_heads:
            attn_mask = attn_mask.reshape(attn_mask.shape[0], kv_heads, group, q_len, k_len)
    block_size = block_size or query_block_size(batch, q_heads, k_len)
    # Not only q, k, v: a score_mod may close over tensors that need gradients (the soft gate's memberships, with a
    # frozen model's q, k, v), and each block's scores would then be kept for backward.
    recompute = torch.is_grad_enabled() and batch * q_heads * q_len * k_len > _RECOMPUTE_ELEMENTS
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out_blocks = out.view(batch, kv_heads, group, q_len, head_dim)
    lse = torch.empty(batch, kv_heads, group, q_len, dtype=compute_dtype, device=q.device)
    for start in range(0, q_len, block_size):
        stop = min(start + block_size, q_len)
        q_pos = torch.arange(start + offset, stop + offset, device=q.device)
        key_stop = stop + offset if causal else k_len
        k_pos = torch.arange(key_stop, device=q.device)
        block_mask = None if attn_mask is None else attn_mask[..., start:stop, :key_stop]
        args = (qg[:, :, :, start:stop], k[:, :, :key_stop], v[:, :, :key_stop], q_pos, k_pos, block_mask)
        kwargs = dict(scale=scale, causal=causal, pair_mask=pair_mask, score_mod=score_mod, softcap=softcap,
                      compute_dtype=compute_dtype)
        if recompute:
            block_out, block_lse = checkpoint(_attend_block, *args, use_reentrant=False, **kwargs)
        else:
            block_out, block_lse = _attend_block(*args, **kwargs)
        out_blocks[:, :, :, start:stop] = block_out
        lse[:, :, :, start:stop] = block_lse
    return out, lse.view(batch, q_heads, q_len)


def _attend_block(qb, k, v, q_pos, k_pos, block_mask, *, scale, causal, pair_mask, score_mod, softcap, compute_dtype):
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qb.to(compute_dtype), k.to(compute_dtype)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if score_mod is not None:
        scores = score_mod(scores, q_pos, k_pos)
    allowed = torch.ones((), dtype=torch.bool, device=qb.device)
    if causal:
        allowed = k_pos[None, :] <= q_pos[:, None]
    if pair_mask is not None:
        pairs = pair_mask(q_pos, k_pos)
        allowed = allowed & pairs.reshape(pairs.shape[0], 1, 1, *pairs.shape[-2:])
    if block_mask is not None:
        allowed = allowed & block_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    probs = torch.exp(scores - row_max)
    total = probs.sum(dim=-1, keepdim=True)
    # total is 0 for a fully masked row and >= 1 otherwise (the row maximum contributes exp(0)), so clamping at 1
    # changes nothing but the empty rows, which then give 0 instead of 0/0.
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.to(compute_dtype)) / total.clamp_min(1.0)
    lse = torch.where(total > 0, row_max + torch.log(total.clamp_min(1.0)), torch.full_like(total, float("-inf")))
    return out, lse.squeeze(-1)
