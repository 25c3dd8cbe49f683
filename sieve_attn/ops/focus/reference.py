"""Plain-PyTorch reference of the Focus attention patterns (hard groups and soft gating).

Both are expressed as a pattern for :func:`sieve_attn.ops.blockwise.blockwise_attention`, so no Tq x Tk tensor is
ever built. Positions follow that module's conventions (queries aligned to the end of the keys).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..blockwise import PairGate, PairMask, ScoreMod, blockwise_attention, query_block_size

# Log-gate floor: log(a + eps) for an affinity a = 0 is about -13.8, which removes a pair as thoroughly as bf16
# softmax can resolve, yet stays finite so gradients reach the router.
LOG_GATE_EPS = 1e-6


def local_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[bq, bk] bool: 0 <= i - j <= window (FlashAttention's window_size=(window, 0))."""
    distance = q_pos[:, None] - k_pos[None, :]
    return (distance >= 0) & (distance <= window)


def group_bits(groups: torch.Tensor) -> torch.Tensor | None:
    """[B, T] int64 bit sets of the groups of each token (bit g set = member of group g), or None when an id is too
    large for one 64-bit word (ids >= 63). groups: [B, T, m], -1 = empty slot."""
    if groups.numel() and int(groups.max()) >= 63:
        return None
    return bit_sets(groups)


def bit_sets(groups: torch.Tensor) -> torch.Tensor:
    """:func:`group_bits` of groups known to hold ids < 63 (not checked: no host sync)."""
    # Four launches (three with one slot per token): a model's router calls this in every layer and step.
    bits = torch.where(groups >= 0, 1 << groups.clamp_min(0), 0)
    if groups.shape[-1] == 1:
        return bits[..., 0]
    return bits.sum(dim=-1)  # ids of a token are distinct, so the sum is the bitwise or


def shared_group_pairs(groups: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       bits: torch.Tensor | None = None) -> torch.Tensor:
    """[B, bq, bk] bool: the two tokens share a group id (slots holding -1 are empty). groups: [B, T, m];
    ``bits``: their :func:`group_bits`, when available, for a single bitwise and per pair."""
    if bits is not None:
        return (bits[:, q_pos, None] & bits[:, None, k_pos]) != 0
    keys = groups[:, k_pos]  # [B, bk, m]
    shared = torch.zeros(groups.shape[0], q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=groups.device)
    for slot in range(groups.shape[2]):
        query_ids = groups[:, q_pos, slot]  # [B, bq]
        hit = (query_ids[:, :, None, None] == keys[:, None, :, :]).any(dim=-1)
        shared |= hit & (query_ids >= 0)[:, :, None]
    return shared


def focus_pair_mask(groups: torch.Tensor, window: int) -> PairMask:
    """Pair mask of the hard Focus pattern: within the window, or sharing a group. groups: [B, T, m]."""
    bits = group_bits(groups)

    def pair_mask(q_pos, k_pos):
        return local_pairs(q_pos, k_pos, window)[None] | shared_group_pairs(groups, q_pos, k_pos, bits)
    return pair_mask


def focus_attention_reference(q, k, v, groups, *, window, causal, scale, softcap=None, attn_mask=None, out=None):
    """Hard Focus pattern. groups: [B, Tk, m] int (-1 = empty slot). Returns (out [B, Hq, Tq, D], lse [B, Hq, Tq])."""
    return blockwise_attention(q, k, v, scale=scale, causal=causal, pair_mask=focus_pair_mask(groups, window),
                               softcap=softcap, attn_mask=attn_mask, out=out)


def soft_gate_score_mod(assign: torch.Tensor, window: int, gate: str, gate_lambda: float) -> ScoreMod:
    """Score modifier of the soft (training-time) Focus gate; assign: [B, T, K] memberships.

    With affinity a_ij = assign_i . assign_j, pairs outside the window get
    - ``gate="log"``: logit + log(a_ij + eps), which tends to the hard mask as memberships harden;
    - ``gate="multiplicative"``: logit * sigmoid(gate_lambda * a_ij), the paper's Eq. 2 read literally.
    Pairs inside the window keep their logit.
    """
    def score_mod(scores, q_pos, k_pos):
        affinity = torch.einsum("bqk,bjk->bqj", assign[:, q_pos].to(scores.dtype), assign[:, k_pos].to(scores.dtype))
        local = local_pairs(q_pos, k_pos, window)[None]
        if gate == "log":
            gated = scores + torch.log(affinity + LOG_GATE_EPS)[:, None, None]
        else:
            gated = scores * torch.sigmoid(gate_lambda * affinity)[:, None, None]
        return torch.where(local[:, None, None], scores, gated)
    return score_mod


def soft_gate_pair_gate(window: int, gate: str, gate_lambda: float) -> PairGate:
    """The soft Focus gate of :func:`soft_gate_score_mod` as a pair gate (``logit * factor + bias``, shared by the
    heads), for :func:`blockwise_attention`'s hand-written backward. Its one gate input is the memberships
    [B, T, K] in the compute dtype. Local pairs get bias 0 (log gate) or factor 1 (multiplicative gate), which leaves
    their logits exactly as they were."""
    def pair_gate(q_pos, k_pos, assign):
        affinity = torch.einsum("bqk,bjk->bqj", assign[:, q_pos], assign[:, k_pos])
        local = local_pairs(q_pos, k_pos, window)[None]
        if gate == "log":
            return None, torch.where(local, torch.zeros((), dtype=affinity.dtype, device=affinity.device),
                                     torch.log(affinity + LOG_GATE_EPS))
        return torch.where(local, torch.ones((), dtype=affinity.dtype, device=affinity.device),
                           torch.sigmoid(gate_lambda * affinity)), None
    return pair_gate


def focus_soft_attention_reference(q, k, v, assign, *, window, gate, gate_lambda, causal, scale, softcap=None,
                                   attn_mask=None):
    """Soft-gated Focus attention over all pairs. assign: [B, Tk, K]. Returns (out, lse).

    The gate is a pair gate of :func:`blockwise_attention`: the same logits as :func:`soft_gate_score_mod`, with
    a hand-written backward that keeps no score block (training runs this on every layer)."""
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    return blockwise_attention(q, k, v, scale=scale, causal=causal,
                               pair_gate=soft_gate_pair_gate(window, gate, gate_lambda),
                               gate_inputs=(assign.to(compute_dtype),), softcap=softcap, attn_mask=attn_mask)


def count_attended_pairs(groups: torch.Tensor, window: int, *, causal: bool = True,
                         q_len: Optional[int] = None) -> tuple[int, int]:
    """(attended, candidate) pair counts of the hard pattern over the last ``q_len`` positions of ``groups`` [B, T, m].

    Candidates are the causal pairs (all pairs when not causal); summed over the batch.
    """
    batch, k_len = groups.shape[:2]
    q_len = k_len if q_len is None else q_len
    pair_mask = focus_pair_mask(groups, window)
    attended = torch.zeros((), dtype=torch.int64, device=groups.device)  # summed on the device: one sync at the end
    block = query_block_size(batch, 1, k_len, groups.device)
    k_pos = torch.arange(k_len, device=groups.device)
    for start in range(k_len - q_len, k_len, block):
        q_pos = torch.arange(start, min(start + block, k_len), device=groups.device)
        allowed = pair_mask(q_pos, k_pos)
        if causal:
            allowed = allowed & (k_pos[None, :] <= q_pos[:, None])[None]
        attended += allowed.sum()
    attended = int(attended)
    offset = k_len - q_len
    candidates = batch * (q_len * offset + q_len * (q_len + 1) // 2 if causal else q_len * k_len)
    return attended, candidates
