"""Public Focus attention ops: argument checks, then the backend that computes them.

Backends of the hard pattern (:func:`focus_attention`):
- ``"reference"``: plain PyTorch, block by block (:mod:`.reference`), any device and dtype.
- ``"dense"``: one SDPA call with the pattern as a boolean mask; exact, O(Tq x Tk) mask, for short sequences.
- ``"triton"``: the pair-set kernels (:mod:`.triton_prefill`) for Tq == Tk, the decode kernel (:mod:`.decode`) for a
  few new queries against a cache; forward and backward.
- ``"sdpa"``: the decomposition (:mod:`.decomposed`): tokens sorted by group, one batched causal SDPA-family call
  (cuDNN first) for the same-group pairs; with two groups per token (causal) a second batched call over the tokens
  of each pair of groups, whose pairs the first counted twice, subtracted in the merge (inclusion-exclusion; the
  backward by the Triton kernels on CUDA); masked calls with more memberships or not causal; the cross-group
  window pairs by the Triton window kernel on CUDA (masked calls elsewhere); merged by log-sum-exp. Tq == Tk, no
  softcap or attn_mask; forward and backward, exact on the CPU and on CUDA. Fastest for one group per token from
  4K tokens per group in 64K tokens (forward; with gradients from 4K per group in 32K) (H200, top-1, x cuDNN, v13:
  64K K=8 5.14-5.76x against the Triton kernels' 4.18-4.40x; v8: 1M K=8 8.76x against 6.40x, 1M K=16 17.46x
  against 12.48x), and for two from 4K per group (v13, forward: 64K K=8 1.51-1.55x against 0.87-0.93x; v11: 256K
  K=8 2.07x against 1.21x); slower with shorter groups and sequences (``SDPA_FROM``).
- ``"flex"``: the same decomposition with FlexAttention (:mod:`.flex`), compiled on CUDA; Tq == Tk, group ids < 63,
  softcap through a score_mod; gradients by autograd on CUDA (its tests, tiny shapes with gradients, passed on the
  H200; not timed), forward only on the CPU.
``"auto"`` on CUDA takes ``"dense"`` below ``DENSE_BELOW`` keys, ``"sdpa"`` for causal prefill with one or two
groups per token from the group and sequence lengths of ``SDPA_FROM`` (shorter ones when gradients are needed: its
backward is cuDNN's too), and the Triton kernels otherwise, decoding included (H200, v18: the dense path that
computes the pattern, masked SDPA on the query's row of it, was 1.6-2.7x slower at 1K-32K cached tokens, even as one
CUDA graph); the reference elsewhere. It never takes ``"flex"``, which serves only when asked for.
:func:`focus_backend` says which backend a call would use and why.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..._checks import check_attention_call, check_choice, check_int, check_positive_float, check_softcap, fail
from ..._checks import check_attn_mask, check_bool, check_qkv, resolve_scale
from ...config import FOCUS_BACKENDS
from ..masked_sdpa import causal_mask, masked_sdpa
from ..triton_common import kernel_blocker
from .decomposed import focus_attention_sdpa, sdpa_blocker
from .flex import flex_blocker, focus_attention_flex
from .groups import FocusGroups
from .reference import focus_attention_reference, focus_pair_mask, focus_soft_attention_reference

# Below this many keys, dense SDPA with the pattern as a mask beats the Triton kernels on the H200. v8
# (benchmarks/results/focus_h200/v8, K=8): 0.91 vs 1.18 ms at 4K (top-1), 0.81 vs 1.35 (top-2); at 8K the Triton
# kernels win, 1.22 vs 2.65 ms (top-1) and 1.16 vs 2.46 (top-2). Both are host-bound there.
DENSE_BELOW = 8192
# Where auto takes the decomposition (causal prefill) over the Triton kernels: (tokens per group T / K, tokens T) it
# needs at least, by (group slots per token, gradients needed). Its group set is one batched cuDNN call (two for two
# groups per token); its host work, about 1 ms, pays off only on long enough calls.
# - One group per token, H200, v14 (benchmarks/results/focus_h200/v14, two runs each, x cuDNN, sdpa vs triton).
#   Forward: 4K per group at 16K / 32K / 64K tokens 0.31-0.43 vs 0.63-0.78x, 1.12-1.75 vs 2.17-2.46x, 4.90-5.68 vs
#   6.92-6.94x; 8K per group at 32K 1.16-1.51 vs 1.77-1.79x, at 64K 4.65-5.61 vs 4.32-4.33x; 16K at 64K 3.30-3.50 vs
#   2.42-2.44x. Forward+backward (the decomposition's backward is cuDNN's too): 4K per group at 16K / 32K / 64K
#   0.62-0.71 vs 0.84-1.11x, 2.37-2.56 vs 2.53-2.55x (even), 5.97-6.11 vs 5.25-5.26x; 8K at 32K 1.80-2.08 vs
#   1.73-1.75x; 2K per group always the Triton kernels (16K 0.64-0.66 vs 1.21-1.34x). Longer groups and sequences
#   gain more (v7: 16K per group at 256K 15.18 vs 11.85x, 128K per group at 1M 9.27 vs 6.86x).
#   v16 (int32 sort keys, the sorts' temporaries dropped after their reads; two runs each, forward): 4K per group at
#   64K / 128K tokens 8.39-8.51 vs 7.03-7.16x / 18.74-18.90 vs 15.26-15.51x, 8K per group at 128K 12.56-12.72 vs
#   9.46-9.52x, 2K per group at 64K even (9.34-10.27 vs 9.98-10.23x): the forward now starts at 4K per group in 64K
#   tokens (at 32K tokens 4K per group stays with the Triton kernels: 1.41 vs 2.85-2.89x, v14's call I).
# - Two groups per token (inclusion-exclusion, the Triton backward), v11 (forward, the bench's default groups): 2K
#   per group (32K, K=16) 1.11 vs 1.05x; 4K (32K, K=8) 0.87 vs 0.67x, (64K, K=16) 2.19 vs 1.52x; 8K (64K, K=8) 1.41
#   vs 0.87x; 32K (256K, K=8) 2.07 vs 1.21x. At 1K per group (8K, K=8) the host-bound sdpa call took 4.0 ms against
#   1.55 ms, so auto starts at 4K rather than at the 2K where it first won.
SDPA_FROM = {(1, False): (4096, 65536), (1, True): (4096, 32768), (2, False): (4096, 0), (2, True): (4096, 0)}
# Query counts up to which a call with Tq < Tk is a decode step for the decode kernel.
DECODE_MAX_QUERIES = 16
GATES = ("log", "multiplicative")
# Backends served here beyond the configurable ones of sieve_attn.config.FOCUS_BACKENDS (a FocusConfig takes only
# those until that list names these too).
BACKENDS = tuple(dict.fromkeys(FOCUS_BACKENDS + ("sdpa", "flex")))


def focus_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Union[torch.Tensor, FocusGroups],
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
            at least one group, and a token lists a group at most once). Shared by all heads. Or a
            :class:`~sieve_attn.ops.focus.groups.FocusGroups` of them, validated once (a decoder's running routing).
        window: pair (i, j) is local when 0 <= i - j <= window (FlashAttention's window_size=(window, 0)).
        causal: only keys at positions <= the query's attend.
        scale: logit scale, default 1/sqrt(D). softcap: logits become softcap * tanh(logit / softcap).
        attn_mask: optional bool [1 or B, 1 or Hq, Tq, Tk], True = may attend (padding); ANDed with the pattern.
        out: optional contiguous [B, Hq, Tq, D] tensor of q's dtype and device, written in place and returned.

    Pair (i, j) is attended iff (j <= i when causal) and (0 <= i - j <= window or i and j share a group id); each
    attended pair is counted once. A query with no attended key (possible only through ``attn_mask``) returns 0 and
    log-sum-exp -inf.

    Returns out [B, Hq, Tq, D] (dtype of q; under ``torch.autocast`` the "dense" backend, which "auto" takes for
    short sequences on CUDA, returns the autocast dtype, as SDPA does), and lse [B, Hq, Tq] (float32, natural log)
    when ``return_lse``; gradients flow to q, k and v from both. The "sdpa" backend's lse carries none: it refuses
    ``return_lse`` while autograd records, and "auto" then takes another backend. The "triton" decode step (Tq < Tk)
    has no backward at all: it refuses q, k or v that require grad, and "auto" takes another backend.
    """
    attn_mask = check_attention_call(q, k, v, attn_mask=attn_mask, out=out)
    groups = FocusGroups.of(groups, q.shape[0], k.shape[2], q.device)
    window = check_int("window", window, 0)
    causal, scale, softcap = check_bool("causal", causal), resolve_scale(scale, q.shape[-1]), check_softcap(softcap)
    return_lse = check_bool("return_lse", return_lse)
    needs_grad = _needs_grad(q, k, v)
    name, _ = _resolve(q, k, groups.num_groups, groups.ids.shape[2], causal=causal, softcap=softcap,
                       attn_mask=attn_mask, backend=backend, return_lse=return_lse, needs_grad=needs_grad)
    if name == "reference":
        result, lse = focus_attention_reference(q, k, v, groups.ids, window=window, causal=causal, scale=scale,
                                                softcap=softcap, attn_mask=attn_mask, out=out)
        return (result, lse.float()) if return_lse else result
    if name == "dense":
        result, lse = _dense(q, k, v, groups.ids, window=window, causal=causal, scale=scale, attn_mask=attn_mask), None
    elif name == "sdpa":
        result, lse = focus_attention_sdpa(q, k, v, groups, window=window, causal=causal, scale=scale)
    elif name == "flex":
        result, lse = focus_attention_flex(q, k, v, groups, window=window, causal=causal, scale=scale, softcap=softcap)
    elif q.shape[2] == k.shape[2]:
        from .triton_prefill import focus_attention_triton
        result, lse = focus_attention_triton(q, k, v, groups.ids, groups.bits, num_groups=groups.num_groups,
                                             window=window, causal=causal, scale=scale, softcap=softcap)
    else:
        from .decode import focus_decode
        result, lse = focus_decode(q, k, v, groups.bits, window=window, scale=scale, softcap=softcap)
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_lse else result


def _needs_grad(*tensors) -> bool:
    """Whether autograd will ask gradients of any of ``tensors`` (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def focus_backend(q: torch.Tensor, k: torch.Tensor, groups: torch.Tensor, *, causal: bool = True,
                  softcap: Optional[float] = None, attn_mask: Optional[torch.Tensor] = None, backend: str = "auto",
                  return_lse: bool = False, v: Optional[torch.Tensor] = None) -> tuple[str, str]:
    """(backend, reason): the backend :func:`focus_attention` uses for these arguments, and why. ``v`` (optional)
    only tells whether gradients will be asked of it, as of q and k.

    Raises ValueError for arguments :func:`focus_attention` refuses (the tensors' layout and the group ids'
    values, which costs a host synchronisation as the op's own check does; not q, k and v's values) and when an
    explicitly requested backend cannot serve the call."""
    check_qkv(q, k, k if v is None else v)
    attn_mask, softcap = check_attn_mask(attn_mask, q, k), check_softcap(softcap)
    groups = FocusGroups.of(groups, q.shape[0], k.shape[2], q.device)
    needs_grad = _needs_grad(q, k, v)
    return _resolve(q, k, groups.num_groups, groups.ids.shape[2], causal=check_bool("causal", causal),
                    softcap=softcap, attn_mask=attn_mask, backend=backend,
                    return_lse=check_bool("return_lse", return_lse), needs_grad=needs_grad)


def _triton_blocker(q, k, num_groups, causal, attn_mask, needs_grad: bool) -> Optional[str]:
    """Why the Triton kernels cannot compute this call, or None when they can (``needs_grad``: gradients will be
    asked of q, k or v)."""
    blocker = kernel_blocker(q, attn_mask)
    if blocker:
        return blocker
    if num_groups > 63:
        return f"the Triton kernels take group ids < 63, got {num_groups - 1}"
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len != k_len and (q_len > DECODE_MAX_QUERIES or not causal):
        return (f"the Triton kernels take Tq == Tk (prefill) or a causal decode step of at most "
                f"{DECODE_MAX_QUERIES} queries, got Tq={q_len}, Tk={k_len}, causal={causal}")
    if q_len != k_len and needs_grad:
        return "the Triton decode kernel (Tq < Tk) has no backward, and q, k or v requires grad"
    return None


def _resolve(q, k, num_groups, memberships, *, causal, softcap, attn_mask, backend, return_lse,
             needs_grad=False) -> tuple[str, str]:
    """(backend, reason) for a call with ``memberships`` group slots per token; ``needs_grad``: gradients will be
    asked of q, k or v. Reads only the shapes, devices and dtypes of q and k (no GPU work, no host sync)."""
    check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return "reference", "requested"
    if backend == "sdpa":
        blocker = sdpa_blocker(q, k, softcap, attn_mask, return_lse and needs_grad)
        if blocker:
            fail("backend", "a call the decomposition backend can compute ('sdpa')", blocker)
        return "sdpa", "requested"
    if backend == "flex":
        blocker = flex_blocker(q, k, num_groups, attn_mask, needs_grad)
        if blocker:
            fail("backend", "a call the FlexAttention decomposition can compute ('flex')", blocker)
        return "flex", "requested"
    blocker = _triton_blocker(q, k, num_groups, causal, attn_mask, needs_grad)
    if backend == "triton":
        if blocker:
            fail("backend", "a call the Triton kernels can compute ('triton')", blocker)
        return "triton", "requested"
    if backend == "dense":
        if return_lse:
            fail("return_lse", "False with backend='dense' (SDPA returns no log-sum-exp)", True)
        if softcap is not None:
            fail("softcap", "None with backend='dense' (SDPA has no logit soft-capping)", softcap)
        return "dense", "requested"
    if blocker:
        return "reference", blocker
    short = q.shape[2] == k.shape[2] and k.shape[2] < DENSE_BELOW
    if q.device.type == "cuda" and short and not return_lse and softcap is None:
        return "dense", f"{k.shape[2]} keys < DENSE_BELOW={DENSE_BELOW}: dense SDPA with the pattern mask is faster"
    if q.device.type != "cuda":
        return "reference", "not on a CUDA device"
    length, group_length = k.shape[2], k.shape[2] // max(num_groups, 1)
    # beyond two groups per token the decomposition takes masked calls, never the faster
    threshold = SDPA_FROM.get((memberships, bool(needs_grad)))
    calls = {1: "one batched cuDNN call for the groups",
             2: "two batched cuDNN calls for the groups (inclusion-exclusion) and the Triton backward"}.get(memberships)
    if (threshold is not None and q.shape[2] == length and causal and group_length >= threshold[0]
            and length >= threshold[1] and sdpa_blocker(q, k, softcap, attn_mask, return_lse and needs_grad) is None):
        return "sdpa", (f"{memberships} group(s) per token, {'with' if needs_grad else 'without'} gradients: "
                        f"{group_length} tokens per group and {length} tokens reach SDPA_FROM's {threshold}, where "
                        f"{calls} run faster than the Triton kernels")
    return "triton", "decode step" if q.shape[2] < k.shape[2] else f"{k.shape[2]} keys >= DENSE_BELOW"


def _dense(q, k, v, groups, *, window, causal, scale, attn_mask):
    """SDPA with the Focus pattern as a [B, 1, Tq, Tk] boolean mask; rows with no key give 0 (not NaN)."""
    q_len, k_len = q.shape[2], k.shape[2]
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    allowed = focus_pair_mask(groups, window)(q_pos, torch.arange(k_len, device=q.device))[:, None]
    if causal:
        allowed = allowed & causal_mask(q_len, k_len, q.device)
    if attn_mask is not None:
        allowed = allowed & attn_mask
    return masked_sdpa(q, k, v, allowed, scale=scale)


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
            a_ij = assign_i . assign_j: 1 for two tokens wholly in one group, 0 for two that share none, K for
            two rows of ones.
        gate: ``"log"`` adds log(a_ij + 1e-6) to the logits of pairs outside the window (tends to the hard mask);
            ``"multiplicative"`` multiplies them by sigmoid(gate_lambda * a_ij) (the paper's Eq. 2, literal).
        Other arguments as in :func:`focus_attention`; the gate acts after softcap.

    Returns out [B, Hq, Tq, D] (and lse [B, Hq, Tq] when ``return_lse``). Gradients flow to q, k, v and assign.
    """
    check_qkv(q, k, v)  # before assign's shape is compared with theirs
    if not isinstance(assign, torch.Tensor) or not assign.dtype.is_floating_point:
        fail("assign", "a float tensor [B, T, K]", getattr(assign, "dtype", type(assign).__name__))
    if assign.dim() != 3 or assign.shape[0] != q.shape[0] or assign.shape[1] != k.shape[2] or assign.shape[2] < 1:
        fail("assign", f"shape [B={q.shape[0]}, T={k.shape[2]}, K>=1]", f"shape {tuple(assign.shape)}")
    if assign.device != q.device:
        fail("assign", f"a tensor on {q.device} (q's device)", assign.device)
    bad_assign = (~torch.isfinite(assign)).any() | (assign < 0).any()
    attn_mask = check_attention_call(q, k, v, attn_mask=attn_mask, value_checks=(
        ("assign", "finite, non-negative memberships", "negative or non-finite values", bad_assign),))
    window = check_int("window", window, 0)
    check_choice("gate", gate, GATES)
    gate_lambda = check_positive_float("gate_lambda", gate_lambda)
    return_lse = check_bool("return_lse", return_lse)
    out, lse = focus_soft_attention_reference(q, k, v, assign, window=window, gate=gate, gate_lambda=gate_lambda,
                                              causal=check_bool("causal", causal),
                                              scale=resolve_scale(scale, q.shape[-1]), softcap=check_softcap(softcap),
                                              attn_mask=attn_mask)
    return (out, lse.float()) if return_lse else out
