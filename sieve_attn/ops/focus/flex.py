"""FlexAttention form of the decomposition (``backend="flex"``): the two disjoint pair sets of :mod:`.decomposed`,
each one ``flex_attention`` call with a block mask, merged by log-sum-exp. FlexAttention differentiates through its
log-sum-exp, so plain autograd gives the gradients of the whole.

- Group set: over the sorted layout of :class:`.decomposed.SortedGroups` ([S, H, L, D], segments padded at their
  end), ``mask_mod`` = both slots real, causal in slot order (position order within a segment), and with several
  memberships no shared group below the segment's (bit sets: group ids < 63).
- Window set: over the sequence in position order [B, H, T, D], ``mask_mod`` = 0 <= i - j <= window and no shared
  group.

Block masks skip fully masked tiles, so each call costs about its own pairs. GQA through ``enable_gqa`` (K and V are
not copied per query head); softcap through a ``score_mod``. On CUDA the masks are built compiled (no T x T tensor)
and ``flex_attention`` runs under ``torch.compile`` (dynamo's automatic dynamic shapes: a new L or T recompiles once,
then shapes are symbolic); on the CPU it runs eagerly, forward only (FlexAttention has no CPU backward), and eager
FlexAttention computes each call's scores densely: the CPU form is for tests and small inputs.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..merge import merge_partials
from .decomposed import SortedGroups
from .groups import FocusGroups


def flex_blocker(q: torch.Tensor, k: torch.Tensor, num_groups: int, attn_mask, needs_grad: bool) -> Optional[str]:
    """Why the FlexAttention form cannot compute this call, or None when it can. ``needs_grad``: gradients will be
    asked of q, k or v."""
    if attn_mask is not None:
        return "the flex backend takes no attn_mask"
    if q.shape[2] != k.shape[2]:
        return f"the flex backend takes Tq == Tk (prefill, training), got Tq={q.shape[2]}, Tk={k.shape[2]}"
    if num_groups > 63:
        return f"the flex backend takes group ids < 63 (its masks test bit sets), got {num_groups - 1}"
    if q.device.type not in ("cpu", "cuda"):
        return f"the flex backend takes CPU or CUDA tensors, got {q.device.type}"
    if q.device.type == "cpu" and needs_grad:
        return ("the flex backend computes no gradients on the CPU (FlexAttention has no CPU backward): call it "
                "under torch.no_grad() or on inputs that need none")
    return None


def focus_attention_flex(q, k, v, groups: FocusGroups, *, window: int, causal: bool, scale: float,
                         softcap: Optional[float] = None):
    """Hard Focus attention through FlexAttention. Arguments as validated by
    :func:`sieve_attn.ops.focus.attention.focus_attention`, with :func:`flex_blocker` None.

    Returns (out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] float32); differentiable in q, k, v (and through lse)."""
    batch, _, length, _ = q.shape
    layout = SortedGroups.of(groups.ids, groups.num_groups)
    attend = functools.partial(_attend, scale=scale, softcap=softcap)
    out_s, lse_s = attend(*(layout.pack(t) for t in (q, k, v)),
                          _group_block_mask(layout, groups.bits, length, causal, q.device))
    base = None
    if window > 0:  # window 0: the window set is empty (a token shares a group with itself)
        out_w, lse_w = attend(q, k, v, _window_block_mask(groups.bits, window, batch, length, q.device))
        base = out_w.transpose(1, 2).flatten(0, 1), lse_w.transpose(1, 2).flatten(0, 1)
    out, lse = merge_partials(base, layout.rows(out_s), layout.rows(lse_s), layout.member_token, batch * length,
                              torch.promote_types(q.dtype, torch.float32))
    out = out.unflatten(0, (batch, length)).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse.unflatten(0, (batch, length)).transpose(1, 2).float().contiguous()


def _group_block_mask(layout: SortedGroups, bits: torch.Tensor, length: int, causal: bool, device):
    """Block mask of the group set over the sorted layout: [S, L] query slots x [S, L] key slots."""
    from torch.nn.attention.flex_attention import create_block_mask

    tokens = layout.slot_tokens()
    slot_bits = torch.where(tokens >= 0, bits.flatten()[tokens.clamp_min(0)], 0)  # [S, L], 0 for padding
    counts, lower, multi = layout.counts, (1 << layout.segment_group) - 1, layout.multi

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (q_idx < counts[b]) & (kv_idx < counts[b])
        if causal:
            allowed = allowed & (kv_idx <= q_idx)
        if multi:  # count a pair only in the lowest group the two tokens share
            allowed = allowed & ((slot_bits[b, q_idx] & slot_bits[b, kv_idx] & lower[b]) == 0)
        return allowed
    return create_block_mask(mask_mod, layout.num_segments, None, layout.length, layout.length, device=device,
                             _compile=torch.device(device).type == "cuda")


def _window_block_mask(bits: torch.Tensor, window: int, batch: int, length: int, device):
    """Block mask of the window set over the sequence: pairs 0 <= i - j <= window whose tokens share no group."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance <= window) & ((bits[b, q_idx] & bits[b, kv_idx]) == 0)
    return create_block_mask(mask_mod, batch, None, length, length, device=device,
                             _compile=torch.device(device).type == "cuda")


def _attend(q, k, v, block_mask, *, scale, softcap):
    """(out, lse) of one flex_attention call; fully masked rows give 0 and -inf."""
    # The main kernel, never the decoding one: torch 2.11 picks the decoding kernel for fewer than 128 query rows
    # and then finds no tiling for it where those rows times the GQA ratio pass 128 (NoValidChoicesError on CUDA
    # at T = 70, 4 query heads on 2 KV heads); every call here is a prefill anyway.
    kwargs = dict(score_mod=None if softcap is None else _capped(softcap), block_mask=block_mask, scale=scale,
                  enable_gqa=q.shape[1] != k.shape[1], kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
    attention, aux_request = _flex(q.device.type)
    if aux_request is None:  # a torch before AuxRequest
        return attention(q, k, v, return_lse=True, **kwargs)
    out, aux = attention(q, k, v, return_aux=aux_request(lse=True), **kwargs)
    return out, aux.lse


def _capped(softcap: float):
    """score_mod of logit soft-capping: softcap * tanh(logit / softcap)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return score_mod


@functools.cache
def _flex(device_type: str):
    """(flex_attention, compiled on CUDA; AuxRequest or None)."""
    from torch.nn.attention import flex_attention as module

    attention = torch.compile(module.flex_attention) if device_type == "cuda" else module.flex_attention
    return attention, getattr(module, "AuxRequest", None)
