"""Public SFA attention op: argument checks, then the backend that computes it.

Backends:
- ``"reference"``: plain PyTorch, block by block (:mod:`.reference`), any device, dtype and padding mask.
- ``"triton"``: the FlashSFA kernels (:mod:`.flash_sfa`), forward and backward from the sparse codes; CUDA (or
  the Triton interpreter), float16/bfloat16/float32, head dims that are powers of two in [16, 256], no attn_mask.
- ``"sdpa"``: PyTorch's dense attention on the zero-filled sparse q and k (:mod:`.sdpa`): any device and dtype,
  padding masks; no softcap, no log-sum-exp. Dense tensor-core speed, no saving from sparsity.
``"auto"`` on CUDA takes "sdpa" whenever it can compute the call (no softcap, no ``return_lse``), else the Triton
kernels when they can, else the reference; on any other device (the CPU) it takes the reference (the interpreter is
for tests only, and nothing was timed there). Why, measured on the H200 (bf16, H=8, D=128, causal;
benchmarks/results/sfa_h200, NOTES v3, side by side in one session): forward at 64K, k=8, sdpa 16.46 ms against
FlashSFA's 113.8 ms (dense cuDNN 14.7 ms); at 16K, k=16, 2.03 against 12.7 ms; forward+backward at 64K, k=8, 54.97
against 2228 ms. :func:`sfa_backend` says
which backend a call would use and why.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..._checks import (FLOAT_DTYPES, check_attention_call, check_bool, check_choice, check_int, check_softcap, fail,
                        resolve_scale)
from ...config import SFA_BACKENDS as BACKENDS
from ..triton_common import choose_backend, kernel_blocker
from .reference import sfa_attention_reference
from .sdpa import check_sdpa_call, sdpa_blocker, sfa_attention_sdpa


def sfa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topk: int = 16,
    causal: bool = True,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
    attn_mask: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
):
    """Sparse Feature Attention: q and k keep only their ``topk`` largest-magnitude coordinates; V stays dense.

    Args:
        q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] with Hq % Hkv == 0 (MHA, GQA, MQA), after RoPE, Tq <= Tk. Query
            i sits at key position Tk - Tq + i, so a decode step passes the new queries with the whole cache. NaN
            and inf are refused in q and in the last Tq keys and values; the earlier ones are taken for a KV
            cache's, checked by the calls that added them (re-reading them would cost a decode step as much as
            dense attention).
        topk: int in [1, D]: coordinates kept per token and head, chosen by largest |x| with ties going to the lower
            coordinate index (:mod:`sieve_attn.ops.sfa.codes`). Each query head selects its own; each KV head
            selects once for its whole group of query heads. topk = D is dense attention.
        causal: only keys at positions <= the query's attend.
        scale: logit scale, default 1/sqrt(D) with D the full head dimension (not 1/sqrt(topk)).
        softcap: logits become softcap * tanh(logit / softcap) (Gemma-2); a zero-overlap pair still scores 0.
        backend: ``"auto"``, ``"reference"``, ``"triton"`` or ``"sdpa"`` (module docstring); ``"triton"`` and
            ``"sdpa"`` raise ValueError for a call they cannot compute.
        attn_mask: optional bool [1 or B, 1 or Hq, Tq, Tk], True = may attend (padding); ANDed with causality.
        out: optional contiguous [B, Hq, Tq, D] tensor of q's dtype and device, written in place and returned.

    With q~ and k~ the zero-filled sparse q and k, the logit of pair (i, j) is scale * (q~_i . k~_j), a sum over
    the coordinates the two supports share: a pair with no shared coordinate scores exactly 0 (not -inf) and
    takes part in the softmax. Then masking, softmax over the attended keys, and P.V with the dense V, as in
    softmax(q~ k~^T * scale) v. A query with no attended key (possible only through ``attn_mask``) returns 0 and
    log-sum-exp -inf. Gradients reach q and k only at their selected coordinates (the paper's straight-through
    rule), and v everywhere.

    Returns out [B, Hq, Tq, D] (dtype of q; under ``torch.autocast`` the ``"sdpa"`` backend returns the autocast
    dtype, as PyTorch's SDPA does), and lse [B, Hq, Tq] (float32, natural log) when ``return_lse``.
    """
    attn_mask = check_attention_call(q, k, v, attn_mask=attn_mask, out=out)
    topk = check_int("topk", topk, 1, q.shape[-1])
    causal, scale, softcap = check_bool("causal", causal), resolve_scale(scale, q.shape[-1]), check_softcap(softcap)
    return_lse = check_bool("return_lse", return_lse)
    resolved, _ = _resolve(q, attn_mask, softcap, return_lse, backend)
    if resolved == "sdpa":
        result = sfa_attention_sdpa(q, k, v, topk=topk, causal=causal, scale=scale, attn_mask=attn_mask)
        return result if out is None else out.copy_(result)
    if resolved == "triton":
        from .flash_sfa import flash_sfa_attention
        result, lse = flash_sfa_attention(q, k, v, topk=topk, causal=causal, scale=scale, softcap=softcap)
        if out is not None:
            result = out.copy_(result)
        return (result, lse) if return_lse else result
    out, lse = sfa_attention_reference(q, k, v, topk=topk, causal=causal, scale=scale, softcap=softcap,
                                       attn_mask=attn_mask, out=out)
    return (out, lse.float()) if return_lse else out


def sfa_backend(q: torch.Tensor, *, softcap: Optional[float] = None, attn_mask: Optional[torch.Tensor] = None,
                return_lse: bool = False, backend: str = "auto") -> tuple[str, str]:
    """(backend, reason): the backend :func:`sfa_attention` uses for a call with these arguments (q [..., D] read
    for its device, dtype and head dim only), and why. Raises ValueError when an explicitly requested backend cannot
    serve the call, as :func:`sfa_attention` does, and for arguments it would refuse: q not a float tensor with a
    head dim D >= 1, attn_mask not a bool tensor (its shape is checked against q and k by :func:`sfa_attention`)."""
    if getattr(q, "dtype", None) not in FLOAT_DTYPES or len(getattr(q, "shape", ())) == 0 or q.shape[-1] == 0:
        fail("q", "a float tensor [..., D] with D >= 1",
             f"{q.dtype} shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__)
    if attn_mask is not None and not (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool):
        fail("attn_mask", "None or a bool tensor", getattr(attn_mask, "dtype", type(attn_mask).__name__))
    return _resolve(q, attn_mask, check_softcap(softcap), check_bool("return_lse", return_lse), backend)


def _resolve(q: torch.Tensor, attn_mask: Optional[torch.Tensor], softcap: Optional[float], return_lse: bool,
             backend: str) -> tuple[str, str]:
    """(backend, reason) for the call; an explicit ``"triton"`` or ``"sdpa"`` that cannot compute it raises
    ValueError (for "sdpa" naming the argument it cannot take). ``"auto"``: module docstring."""
    check_choice("backend", backend, BACKENDS)
    if backend == "sdpa":
        check_sdpa_call(softcap, return_lse)
        return "sdpa", "requested"
    if backend != "auto":
        return choose_backend(backend, q, kernel_blocker(q, attn_mask)), "requested"
    if q.device.type != "cuda":
        return "reference", f"auto takes the GPU backends on CUDA devices only, q is on {q.device}"
    cannot_sdpa = sdpa_blocker(softcap, return_lse)
    if cannot_sdpa is None:
        return "sdpa", ("auto on CUDA: dense SDPA on the zero-filled codes outruns FlashSFA (H200, 64K, k=8: forward "
                        "16.46 vs 113.8 ms, forward+backward 54.97 vs 2228 ms)")
    blocker = kernel_blocker(q, attn_mask)
    if blocker is None:
        return "triton", f"auto on CUDA: not sdpa ({cannot_sdpa}); the Triton kernels take the call"
    return "reference", f"auto on CUDA: not sdpa ({cannot_sdpa}), not triton ({blocker})"
