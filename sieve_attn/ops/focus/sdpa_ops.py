"""Fused attention calls that return the log-sum-exp, and their backward passes: one small pair of functions per op
family, each a thin wrapper of the private ATen op behind ``scaled_dot_product_attention`` (the public function
returns no log-sum-exp).

Forward ``forward(q, k, v, allowed, scale) -> (out, lse, saved)``:
- q [N, Hq, M, D]; k, v [N, Hkv, S, D] with Hq % Hkv == 0, query head h reading KV head h // (Hq // Hkv) (GQA, MQA);
  last dimension contiguous, other strides free.
- ``allowed``: None for a causal call (key index <= query index, M == S), or a bool [N, 1, M, S] mask shared by the
  heads (True = may attend), for the families with ``masked``.
- out [N, Hq, M, D] in q's dtype; lse [N, Hq, M] natural log, float32 (float64 for float64 inputs on the CPU);
  ``saved``: what the family's backward needs besides tensors it can recompute (dropout seeds, sequence counters).
- A row with no allowed key has an undefined result (0 with lse 0 on the CPU, NaN in some CUDA kernels): callers
  overwrite such rows.

Backward ``backward(grad_out, q, k, v, out, lse, allowed, saved, scale) -> (dq, dk, dv)`` in the inputs' dtypes (the
masked families, CPU and memory-efficient: float32 for 16-bit inputs, which callers sum in float32 anyway).
``out`` and ``lse`` [N, Hq, M] are the caller's: a FlashAttention-2 backward reads only P = exp(s - lse) and
delta = rowsum(grad_out * out), so the final (merged) output and log-sum-exp of the query rows give this call's share
of the exact gradient. No gradient flows through lse.

Families (schemas as in torch 2.11 and 2.13; tests/ops/test_focus_sdpa.py checks them against the installed torch):
- ``cpu``: ``_scaled_dot_product_flash_attention_for_cpu``; causal or masked (additive ``attn_mask``), GQA native.
- ``cudnn``: ``_scaled_dot_product_cudnn_attention``; causal only here, GQA native.
- ``flash``: ``_scaled_dot_product_flash_attention``; causal only, GQA native.
- ``efficient``: ``_scaled_dot_product_efficient_attention``; causal or masked (additive bias). Its kernel takes no
  GQA, so it runs once per query head, on views of that head and of its KV head; K and V are never copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

_ATEN = torch.ops.aten
# The memory-efficient kernel reads bias rows in aligned vectors: SDPA pads its masks' rows to this many elements.
_BIAS_ALIGN = 16
# The memory-efficient kernel's log-sum-exp rows are padded to a multiple of this many queries.
_LSE_ALIGN = 32


@dataclass(frozen=True)
class Family:
    """One op family: its forward and backward (see the module docstring) and whether it takes a mask."""

    name: str
    forward: Callable
    backward: Callable
    masked: bool


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """[N, 1, M, S] additive mask in ``dtype``: 0 where ``allowed``, -inf elsewhere (what SDPA makes of a bool mask).
    Rows are allocated with a multiple of ``align`` elements, then sliced to S."""
    n, _, m, s = allowed.shape
    width = -(-s // align) * align
    bias = torch.full((n, 1, m, width), float("-inf"), dtype=dtype, device=allowed.device)[..., :s]
    return bias.masked_fill_(allowed, 0.0)


# ---------------------------------------------------------------------------------------------------- cpu

def cpu_forward(q, k, v, allowed, scale):
    bias = None if allowed is None else additive_bias(allowed, q.dtype)
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, allowed is None, attn_mask=bias,
                                                                 scale=scale)
    return out, lse, None


def _widened(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in float32 (16-bit ones; float32 and float64 stay): the masked families' backward runs there and
    returns float32 shares, since the decomposition sums several calls' shares per token (copies, query chunks, the
    window set), and shares rounded to 16 bits each made those sums err more than twice a dense 16-bit call's
    gradients (1.05-1.09x in 4 of 200 seeds of a random top-2 sweep)."""
    return [t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors]


def cpu_backward(grad_out, q, k, v, out, lse, allowed, saved, scale):
    """16-bit inputs run in float32 and their gradients come in float32 (:func:`_widened`)."""
    grad_out, q, k, v, out = _widened(grad_out, q, k, v, out)
    bias = None if allowed is None else additive_bias(allowed, q.dtype)
    return _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse.to(q.dtype), 0.0, allowed is None, attn_mask=bias, scale=scale)


# ---------------------------------------------------------------------------------------------------- cudnn (CUDA)

def cudnn_forward(q, k, v, allowed, scale):
    """Causal only; lse comes as [N, Hq, M, 1]."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _ATEN._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse.squeeze(-1), (seed, offset, cum_q, cum_k, max_q, max_k)


def cudnn_backward(grad_out, q, k, v, out, lse, allowed, saved, scale):
    seed, offset, cum_q, cum_k, max_q, max_k = saved
    return _ATEN._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
        True, scale=scale)


# ---------------------------------------------------------------------------------------------------- flash (CUDA)

def flash_forward(q, k, v, allowed, scale):
    """Causal only; lse comes as [N, Hq, M]."""
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = _ATEN._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)


def flash_backward(grad_out, q, k, v, out, lse, allowed, saved, scale):
    cum_q, cum_k, max_q, max_k, rng_state, unused = saved
    return _ATEN._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, True, rng_state, unused,
        scale=scale)


# ---------------------------------------------------------------------------------------------------- efficient (CUDA)

def _head_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """For each query head h: views [N, 1, ...] of q's head h and of K and V's head h // (Hq // Hkv)."""
    group = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        kv = h // group
        yield q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1]


def efficient_forward(q, k, v, allowed, scale):
    """One call per query head, each with its KV head and the [N, 1, M, S] bias as it is (never expanded over
    heads: with a head-broadcast bias the bfloat16 backward gave wrong gradients on an H200); lse comes as
    [N, 1, M rounded up to 32] per call."""
    bias, queries = None if allowed is None else additive_bias(allowed, q.dtype, _BIAS_ALIGN), q.shape[2]
    outs, lses, saved = [], [], []
    for q_h, k_h, v_h in _head_views(q, k, v):
        out, lse, seed, offset = _ATEN._scaled_dot_product_efficient_attention(
            q_h, k_h, v_h, bias, True, 0.0, allowed is None, scale=scale)
        outs.append(out)
        lses.append(lse[..., :queries])
        saved.append((seed, offset))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1), saved


def efficient_backward(grad_out, q, k, v, out, lse, allowed, saved, scale):
    """As :func:`cpu_backward`, 16-bit inputs run in float32 and the gradients come in float32 (the kernel takes
    float32 on sm80 and later)."""
    grad_out, q, k, v, out = _widened(grad_out, q, k, v, out)
    bias, queries = None if allowed is None else additive_bias(allowed, q.dtype, _BIAS_ALIGN), q.shape[2]
    padded = lse.new_zeros(*lse.shape[:2], -(-queries // _LSE_ALIGN) * _LSE_ALIGN)
    padded[..., :queries] = lse
    group = q.shape[1] // k.shape[1]
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for h, ((q_h, k_h, v_h), (seed, offset)) in enumerate(zip(_head_views(q, k, v), saved, strict=True)):
        rows = slice(h, h + 1)
        # Contiguous copies of the head's rows: what the forward returned had that layout.
        dq_h, dk_h, dv_h, _ = _ATEN._scaled_dot_product_efficient_attention_backward(
            grad_out[:, rows].contiguous(), q_h, k_h, v_h, bias, out[:, rows].contiguous(),
            padded[:, rows].contiguous(), seed, offset, 0.0, [True, True, True, False], allowed is None, scale=scale)
        dqs.append(dq_h)
        dk[:, h // group] += dk_h[:, 0]
        dv[:, h // group] += dv_h[:, 0]
    return torch.cat(dqs, dim=1), dk, dv


FAMILIES = {family.name: family for family in (
    Family("cpu", cpu_forward, cpu_backward, masked=True),
    Family("cudnn", cudnn_forward, cudnn_backward, masked=False),
    Family("flash", flash_forward, flash_backward, masked=False),
    Family("efficient", efficient_forward, efficient_backward, masked=True),
)}


# ---------------------------------------------------------------------------------------------------- choosing

def masked_family(device: torch.device) -> Family:
    """The family of the masked calls on ``device``: the one family there that takes a mask."""
    family = FAMILIES["efficient" if device.type == "cuda" else "cpu"]
    assert family.masked
    return family


def causal_families(q, k, v) -> list[Family]:
    """Families that may take a causal call on these inputs, fastest first: cuDNN, then flash (each when PyTorch's
    own SDPA dispatcher says it can), then the memory-efficient kernel; the CPU family off CUDA."""
    if q.device.type != "cuda":
        return [FAMILIES["cpu"]]
    usable = {"cudnn": torch.backends.cuda.can_use_cudnn_attention,
              "flash": torch.backends.cuda.can_use_flash_attention}
    return [FAMILIES[name] for name, check in usable.items() if _dispatcher_allows(check, q, k, v)] + \
        [FAMILIES["efficient"]]


def _dispatcher_allows(check: Callable, q, k, v) -> bool:
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
    except TypeError:  # another SDPAParams signature: try the op, the caller falls back if it refuses
        return True
    return bool(check(params, False))


def causal_call(q, k, v, scale) -> tuple[Family, torch.Tensor, torch.Tensor, Optional[object]]:
    """(family, out, lse, saved) of a causal call by the first of :func:`causal_families` that takes it."""
    refusals = []
    for family in causal_families(q, k, v):
        try:
            return (family, *family.forward(q, k, v, None, scale))
        except RuntimeError as error:  # a kernel that refuses these shapes: try the next one
            refusals.append(f"{family.name}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
    raise RuntimeError("no fused attention op took the causal same-group call; " + "; ".join(refusals))
