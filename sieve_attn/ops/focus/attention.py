"""Public Focus attention ops: argument checks, then the backend that computes them.

Only the plain-PyTorch reference backend exists for now; ``backend="auto"`` resolves to it on every device.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..._checks import check_attention_call, check_choice, check_int, check_positive_float, check_softcap, fail
from ..._checks import resolve_scale
from .reference import focus_attention_reference, focus_soft_attention_reference

BACKENDS = ("auto", "reference")
GATES = ("log", "multiplicative")


def check_groups(groups: torch.Tensor, batch: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Validates ``groups`` ([B, T] or [B, T, m] ints) and returns it as [B, T, m]."""
    if not isinstance(groups, torch.Tensor):
        fail("groups", "an integer tensor [B, T] or [B, T, m]", type(groups).__name__)
    if groups.dtype.is_floating_point or groups.dtype.is_complex or groups.dtype == torch.bool:
        fail("groups", "an integer dtype", groups.dtype)
    if groups.dim() not in (2, 3):
        fail("groups", f"shape [B, T] or [B, T, m] with B={batch}, T={k_len}", f"shape {tuple(groups.shape)}")
    if groups.shape[0] != batch or groups.shape[1] != k_len:
        fail("groups", f"shape [B, T, ...] with B={batch}, T={k_len} (one entry per key token)",
             f"shape {tuple(groups.shape)}")
    if groups.device != device:
        fail("groups", f"a tensor on {device}", groups.device)
    slots = groups if groups.dim() == 3 else groups[..., None]
    if slots.shape[2] == 0:
        fail("groups", "at least one membership slot (m >= 1)", "m = 0")
    if slots.numel() == 0:
        return slots.long()
    low = -1 if groups.dim() == 3 else 0
    if int(slots.min()) < low:
        fail("groups", f"group ids >= {low}" + (" (-1 marks an empty slot)" if low < 0 else ""), int(slots.min()))
    if not bool((slots >= 0).any(dim=-1).all()):
        fail("groups", "every token in at least one group", "a token whose slots are all -1")
    ordered = slots.sort(dim=-1).values
    if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
        fail("groups", "distinct group ids among a token's slots", "a token listing one group twice")
    return slots.long()


def focus_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: torch.Tensor,
    *,
    window: int = 128,
    causal: bool = True,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
    attn_mask: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
):
    """Focus attention with a hard group pattern.

    Args:
        q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] with Hq % Hkv == 0 (MHA, GQA, MQA). Query i sits at key position
            Tk - Tq + i, so a decode step passes the new queries with the whole cache.
        groups: int [B, Tk] (one group per token) or [B, Tk, m] (m memberships, -1 = empty slot; every token needs
            at least one group, and a token lists a group at most once). Shared by all heads.
        window: pair (i, j) is local when 0 <= i - j <= window (FlashAttention's window_size=(window, 0)).
        causal: only keys at positions <= the query's attend.
        scale: logit scale, default 1/sqrt(D). softcap: logits become softcap * tanh(logit / softcap).
        attn_mask: optional bool [1 or B, 1 or Hq, Tq, Tk], True = may attend (padding); ANDed with the pattern.
        out: optional contiguous [B, Hq, Tq, D] tensor of q's dtype and device, written in place and returned.

    Pair (i, j) is attended iff (j <= i when causal) and (0 <= i - j <= window or i and j share a group id); each
    attended pair is counted once. A query with no attended key (possible only through ``attn_mask``) returns 0 and
    log-sum-exp -inf.

    Returns out [B, Hq, Tq, D] (dtype of q), and lse [B, Hq, Tq] (float32, natural log) when ``return_lse``.
    """
    attn_mask = check_attention_call(q, k, v, attn_mask=attn_mask, out=out)
    groups = check_groups(groups, q.shape[0], k.shape[2], q.device)
    window = check_int("window", window, 0)
    check_choice("backend", backend, BACKENDS)
    out, lse = focus_attention_reference(q, k, v, groups, window=window, causal=bool(causal),
                                         scale=resolve_scale(scale, q.shape[-1]), softcap=check_softcap(softcap),
                                         attn_mask=attn_mask, out=out)
    return (out, lse.float()) if return_lse else out


def focus_soft_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    assign: torch.Tensor,
    *,
    window: int = 128,
    gate: str = "log",
    causal: bool = True,
    scale: Optional[float] = None,
    gate_lambda: float = 10.0,
    softcap: Optional[float] = None,
    attn_mask: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """Soft-gated Focus attention (training): every pair is computed, distant pairs are gated by group affinity.

    Args:
        assign: [B, Tk, K] non-negative soft memberships (rows usually sum to 1); the affinity of a pair is
            a_ij = assign_i . assign_j. A row of ones makes a token affine to every token (a = 1).
        gate: ``"log"`` adds log(a_ij + 1e-6) to the logits of pairs outside the window (tends to the hard mask);
            ``"multiplicative"`` multiplies them by sigmoid(gate_lambda * a_ij) (the paper's Eq. 2, literal).
        Other arguments as in :func:`focus_attention`; the gate acts after softcap.

    Returns out [B, Hq, Tq, D] (and lse [B, Hq, Tq] when ``return_lse``). Gradients flow to q, k, v and assign.
    """
    attn_mask = check_attention_call(q, k, v, attn_mask=attn_mask)
    if not isinstance(assign, torch.Tensor) or not assign.dtype.is_floating_point:
        fail("assign", "a float tensor [B, T, K]", getattr(assign, "dtype", type(assign).__name__))
    if assign.dim() != 3 or assign.shape[0] != q.shape[0] or assign.shape[1] != k.shape[2] or assign.shape[2] < 1:
        fail("assign", f"shape [B={q.shape[0]}, T={k.shape[2]}, K>=1]", f"shape {tuple(assign.shape)}")
    if not bool(torch.isfinite(assign).all()) or bool((assign < 0).any()):
        fail("assign", "finite, non-negative memberships", "negative or non-finite values")
    window = check_int("window", window, 0)
    check_choice("gate", gate, GATES)
    gate_lambda = check_positive_float("gate_lambda", gate_lambda)
    out, lse = focus_soft_attention_reference(q, k, v, assign, window=window, gate=gate, gate_lambda=gate_lambda,
                                              causal=bool(causal), scale=resolve_scale(scale, q.shape[-1]),
                                              softcap=check_softcap(softcap), attn_mask=attn_mask)
    return (out, lse.float()) if return_lse else out
