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

Two ways to change logits. A ``score_mod`` is any function of the [B, Hkv, G, bq, bk] scores; autograd records every
block (or, for long sequences, recomputes it through ``torch.utils.checkpoint``). A ``pair_gate`` is restricted to
``logit * factor + bias`` with factor and bias shared by the heads ([B or 1, bq, bk]); attention then runs through a
hand-written backward (FlashAttention's: the forward keeps only the output and the log-sum-exp, the backward
recomputes each block once), which keeps no block, launches a few kernels per block, and computes the head-sized
work once per block instead of through the whole autograd graph of it. The soft Focus gate is a pair gate.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from .._checks import fail

PairMask = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PairGate = Callable[..., tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]

# Elements of one block's score tensor. On the CPU 2**22 float32 values (16 MiB) take milliseconds per operation, so
# the Python loop over blocks costs little. An accelerator gets through such a block in microseconds, about the
# time it takes to launch one kernel, so small blocks would leave it waiting on Python: there blocks are 16x larger
# (2**26 values, 256 MiB in float32; at 4K tokens, batch 2 and 9 heads that is 5 blocks per layer instead of 74).
_BLOCK_ELEMENTS = 2 ** 22
_ACCELERATOR_BLOCK_ELEMENTS = 2 ** 26
# Under autograd, blocks are recomputed in the backward pass (instead of stored) only when the whole score tensor
# would exceed this many elements (512 MiB in float32); below it, storing is cheaper than recomputing.
_RECOMPUTE_ELEMENTS = 2 ** 27


def query_block_size(batch: int, heads: int, keys: int, device: Optional[torch.device] = None) -> int:
    """Query rows per block: about _BLOCK_ELEMENTS scores per block (_ACCELERATOR_BLOCK_ELEMENTS off the CPU)."""
    budget = _BLOCK_ELEMENTS if device is None or torch.device(device).type == "cpu" else _ACCELERATOR_BLOCK_ELEMENTS
    rows = budget // max(1, batch * heads * keys)
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
    pair_gate: Optional[PairGate] = None,
    gate_inputs: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the pairs allowed by ``causal``, ``pair_mask`` and ``attn_mask`` (all must allow a pair).

    pair_mask(q_pos [bq], k_pos [bk]) -> bool [B or 1, bq, bk]: True where the pair may attend (shared by heads).
    score_mod(scores [B, Hkv, G, bq, bk], q_pos, k_pos) -> scores of the same shape (float32 or wider).
    attn_mask: bool [B or 1, 1 or Hq, Tq, Tk], True = may attend (transformers' boolean mask convention).

    out: optional [B, Hq, Tq, D] tensor of q's dtype; every query block is written into it in place.
    pair_gate(q_pos, k_pos, *gate_inputs) -> (factor, bias), each None or [B or 1, bq, bk] in the compute dtype
    (float32 or wider), shared by the heads: the logit of a pair becomes ``logit * factor + bias`` (after softcap,
    before masking). Gradients reach the tensors of ``gate_inputs`` (and q, k, v) through a hand-written backward.
    Not combined with ``score_mod``.

    Returns ``out`` [B, Hq, Tq, D] in q's dtype and ``lse`` [B, Hq, Tq] (natural log, float32 or wider).
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(batch, kv_heads, group, q_len, head_dim)
    if attn_mask is not None:
        attn_mask = _grouped_mask(attn_mask, kv_heads, group, q_len, k_len)
    block_size = block_size or query_block_size(batch, q_heads, k_len, q.device)
    if pair_gate is not None:
        if score_mod is not None:
            fail("pair_gate", "None when score_mod is given (one of the two modifies the scores)", "a pair gate")
        settings = _GateSettings(scale=scale, causal=causal, pair_mask=pair_mask, pair_gate=pair_gate,
                                 softcap=softcap, block_size=block_size)
        gated_out, lse = _GatedAttention.apply(settings, qg, k, v, attn_mask, *gate_inputs)
        gated_out = gated_out.view(q.shape)
        if out is None:
            return gated_out, lse.view(batch, q_heads, q_len)
        out.copy_(gated_out)
        return out, lse.view(batch, q_heads, q_len)
    # Not only q, k, v: a score_mod may close over tensors that need gradients (memberships, with a frozen model's
    # q, k, v), and each block's scores would then be kept for backward.
    recompute = torch.is_grad_enabled() and batch * q_heads * q_len * k_len > _RECOMPUTE_ELEMENTS
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out_blocks = out.view(batch, kv_heads, group, q_len, head_dim)
    lse = torch.empty(batch, kv_heads, group, q_len, dtype=compute_dtype, device=q.device)
    for start, stop, q_pos, key_stop, k_pos in _blocks(block_size, causal, q_len, k_len, q.device):
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


def _grouped_mask(attn_mask: torch.Tensor, kv_heads: int, group: int, q_len: int, k_len: int) -> torch.Tensor:
    """attn_mask [B or 1, 1 or Hq, Tq, Tk] -> [B or 1, 1 or Hkv, 1 or G, Tq, Tk], the layout of the score blocks."""
    attn_mask = attn_mask.unsqueeze(2)
    if attn_mask.shape[1] == kv_heads * group:
        attn_mask = attn_mask.reshape(attn_mask.shape[0], kv_heads, group, q_len, k_len)
    return attn_mask


def _attend_block(qb, k, v, q_pos, k_pos, block_mask, *, scale, causal, pair_mask, score_mod, softcap, compute_dtype):
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qb.to(compute_dtype), k.to(compute_dtype)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if score_mod is not None:
        scores = score_mod(scores, q_pos, k_pos)
    allowed = _allowed(causal, pair_mask, q_pos, k_pos, block_mask)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return _softmax_values(scores, v.to(compute_dtype))


def _softmax_values(scores, v, in_place: bool = False):
    """(softmax(scores) @ v [B, Hkv, G, bq, D], lse [B, Hkv, G, bq]) of masked logits [B, Hkv, G, bq, bk]; a fully
    masked row gives out 0 and lse -inf. ``in_place`` reuses ``scores`` for the probabilities (no autograd)."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    probs = scores.sub_(row_max).exp_() if in_place else torch.exp(scores - row_max)
    total = probs.sum(dim=-1, keepdim=True)
    # total is 0 for a fully masked row and >= 1 otherwise (the row maximum contributes exp(0)), so clamping at 1
    # changes nothing but the empty rows, which then give 0 instead of 0/0.
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v) / total.clamp_min(1.0)
    lse = torch.where(total > 0, row_max + torch.log(total.clamp_min(1.0)), torch.full_like(total, float("-inf")))
    return out, lse.squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------
# Pair gate: logits * factor + bias with factor and bias shared by the heads, and a hand-written backward
# ----------------------------------------------------------------------------------------------------------------

class _GateSettings:
    """The non-tensor arguments of :class:`_GatedAttention` (one object, so autograd sees one non-tensor input)."""

    def __init__(self, *, scale, causal, pair_mask, pair_gate, softcap, block_size):
        self.scale, self.causal, self.pair_mask, self.pair_gate = scale, causal, pair_mask, pair_gate
        self.softcap, self.block_size = softcap, block_size

    def blocks(self, q_len: int, k_len: int, device):
        return _blocks(self.block_size, self.causal, q_len, k_len, device)


def _blocks(block_size: int, causal: bool, q_len: int, k_len: int, device):
    """(start, stop, q_pos, key_stop, k_pos) for every query block: rows start..stop of the queries, at key positions
    q_pos, against the keys 0..key_stop (those up to the block's last query when causal)."""
    offset = k_len - q_len
    for start in range(0, q_len, block_size):
        stop = min(start + block_size, q_len)
        key_stop = stop + offset if causal else k_len
        yield (start, stop, torch.arange(start + offset, stop + offset, device=device), key_stop,
               torch.arange(key_stop, device=device))


def _allowed(causal: bool, pair_mask: Optional[PairMask], q_pos, k_pos, block_mask) -> Optional[torch.Tensor]:
    """bool mask of a block, broadcastable to [B, Hkv, G, bq, bk], or None when every pair may attend."""
    allowed = None
    if causal:
        allowed = k_pos[None, :] <= q_pos[:, None]
    if pair_mask is not None:
        pairs = pair_mask(q_pos, k_pos)
        pairs = pairs.reshape(pairs.shape[0], 1, 1, *pairs.shape[-2:])
        allowed = pairs if allowed is None else allowed & pairs
    if block_mask is not None:
        allowed = block_mask if allowed is None else allowed & block_mask
    return allowed


def _gated_logits(settings, qb, k, q_pos, k_pos, block_mask, gate_inputs, compute_dtype, keep=False):
    """Masked logits [B, Hkv, G, bq, bk] of one block, built in place: scale * q.k, softcap, * factor + bias, then
    -inf where not allowed (folded into the head-shared bias when the mask is head-shared).

    ``keep=True`` (backward) also returns (capped, tanh, factor, bias): the logits before the gate (only when the
    factor needs a gradient), the tanh of the softcap (or None), and the gate's own outputs, which carry the graph to
    ``gate_inputs`` when those need gradients.
    """
    factor, bias = settings.pair_gate(q_pos, k_pos, *gate_inputs)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qb.to(compute_dtype), k.to(compute_dtype))
    scores.mul_(settings.scale)
    tanh = None
    if settings.softcap is not None:
        tanh = scores.div_(settings.softcap).tanh_()
        scores = tanh * settings.softcap if keep else tanh.mul_(settings.softcap)
    capped = scores.clone() if keep and factor is not None and factor.requires_grad else None
    if factor is not None:
        scores.mul_(factor.detach()[:, None, None])
    allowed = _allowed(settings.causal, settings.pair_mask, q_pos, k_pos, block_mask)
    shift = None if bias is None else bias.detach()[:, None, None]
    if allowed is not None and (allowed.dim() == 2 or allowed.shape[1:3] == (1, 1)):
        # Head-shared mask ([bq, bk] causal, or [B, 1, 1, bq, bk]): -inf goes into the head-shared shift (bias +
        # -inf is the -inf masked_fill would write).
        shift = torch.where(allowed, torch.zeros((), dtype=compute_dtype, device=scores.device) if shift is None
                            else shift, float("-inf"))
        allowed = None
    if shift is not None:
        scores.add_(shift)
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    if keep:
        return scores, (capped, tanh, factor, bias)
    return scores


class _GatedAttention(torch.autograd.Function):
    """Blockwise attention with a pair gate; forward keeps (q, k, v, out, lse), backward recomputes every block once.

    Inputs: settings, qg [B, Hkv, G, Tq, D], k, v [B, Hkv, Tk, D], attn_mask (grouped, or None), *gate_inputs.
    Outputs: out [B, Hkv, G, Tq, D] in q's dtype, lse [B, Hkv, G, Tq] in the compute dtype.
    """

    @staticmethod
    def forward(ctx, settings, qg, k, v, attn_mask, *gate_inputs):
        compute_dtype = torch.promote_types(qg.dtype, torch.float32)
        q_len, k_len = qg.shape[3], k.shape[2]
        out = torch.empty(qg.shape, dtype=compute_dtype, device=qg.device)
        lse = torch.empty(qg.shape[:4], dtype=compute_dtype, device=qg.device)
        for start, stop, q_pos, key_stop, k_pos in settings.blocks(q_len, k_len, qg.device):
            block_mask = None if attn_mask is None else attn_mask[..., start:stop, :key_stop]
            probs = _gated_logits(settings, qg[:, :, :, start:stop], k[:, :, :key_stop], q_pos, k_pos, block_mask,
                                  gate_inputs, compute_dtype)
            out[:, :, :, start:stop], lse[:, :, :, start:stop] = _softmax_values(
                probs, v[:, :, :key_stop].to(compute_dtype), in_place=True)
        ctx.settings = settings
        ctx.save_for_backward(qg, k, v, attn_mask, out, lse, *gate_inputs)
        return out.to(qg.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        settings = ctx.settings
        qg, k, v, attn_mask, out, lse, *gate_inputs = ctx.saved_tensors
        qg, k, v = qg.detach(), k.detach(), v.detach()
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        need_gate = [bool(n) for n in ctx.needs_input_grad[5:]]
        compute_dtype = out.dtype
        q_len, k_len = qg.shape[3], k.shape[2]
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(compute_dtype)
        # delta_i = sum_d dO_i O_i (minus the lse's gradient, which enters every logit of the row with weight p)
        delta = (grad_out * out).sum(dim=-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(compute_dtype)
        # exp(s - lse) of a fully masked row (lse = -inf, s = -inf) must give 0, not NaN
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
        dq = torch.zeros(qg.shape, dtype=compute_dtype, device=qg.device) if need_q else None
        dk = torch.zeros(k.shape, dtype=compute_dtype, device=k.device) if need_k else None
        dv = torch.zeros(v.shape, dtype=compute_dtype, device=v.device) if need_v else None
        gate_args = [g.detach().requires_grad_(n) for g, n in zip(gate_inputs, need_gate)]
        gate_wanted = [g for g, n in zip(gate_args, need_gate) if n]
        for start, stop, q_pos, key_stop, k_pos in settings.blocks(q_len, k_len, qg.device):
            block_mask = None if attn_mask is None else attn_mask[..., start:stop, :key_stop]
            qb, kb, vb = qg[:, :, :, start:stop], k[:, :, :key_stop], v[:, :, :key_stop]
            with torch.enable_grad() if gate_wanted else torch.no_grad():
                probs, (capped, tanh, factor, bias) = _gated_logits(settings, qb, kb, q_pos, k_pos, block_mask,
                                                                    gate_args, compute_dtype, keep=True)
            probs.sub_(lse[:, :, :, start:stop, None]).exp_()
            d_out = grad_out[:, :, :, start:stop]
            if need_v:
                dv[:, :, :key_stop] += torch.einsum("bhgqk,bhgqd->bhkd", probs, d_out)
            d_scores = torch.einsum("bhgqd,bhkd->bhgqk", d_out, vb.to(compute_dtype))
            d_scores.sub_(delta[:, :, :, start:stop, None]).mul_(probs)
            del probs
            gate_outputs, gate_out_grads = [], []
            if bias is not None and bias.requires_grad:
                gate_outputs.append(bias)
                gate_out_grads.append(_sum_to(d_scores.sum(dim=(1, 2)), bias.shape))
            if factor is not None and factor.requires_grad:
                gate_outputs.append(factor)
                gate_out_grads.append(_sum_to((d_scores * capped).sum(dim=(1, 2)), factor.shape))
            if gate_outputs:  # accumulates into the .grad of the detached gate inputs
                torch.autograd.backward(gate_outputs, gate_out_grads, inputs=gate_wanted)
            if not (need_q or need_k):
                continue
            if factor is not None:
                d_scores.mul_(factor.detach()[:, None, None])
            if tanh is not None:
                d_scores.mul_(1 - tanh * tanh)
            d_scores.mul_(settings.scale)
            if need_q:
                dq[:, :, :, start:stop] = torch.einsum("bhgqk,bhkd->bhgqd", d_scores, kb.to(compute_dtype))
            if need_k:
                dk[:, :, :key_stop] += torch.einsum("bhgqk,bhgqd->bhkd", d_scores, qb.to(compute_dtype))
        gate_grads = [(torch.zeros_like(g) if g.grad is None else g.grad) if n else None
                      for g, n in zip(gate_args, need_gate)]
        return (None, _cast(dq, qg), _cast(dk, k), _cast(dv, v), None, *gate_grads)


def _sum_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """grad summed over the dimensions a tensor of ``shape`` was broadcast along."""
    dims = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _cast(grad: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    return None if grad is None else grad.to(like.dtype)
