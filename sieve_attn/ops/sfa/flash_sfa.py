"""FlashSFA in Triton: SFA attention straight from the sparse codes of q and k, forward and backward.

Semantics are those of :func:`.reference.sfa_attention_reference`: the score of query i and key j is
``scale * sum over the coordinates both keep of q_iu * k_ju`` (a pair with no shared coordinate scores 0 and takes
part in the softmax), queries sit at key positions ``Tk - Tq + i``, V is dense, and the gradients of q and k exist
only at the kept coordinates (the straight-through rule), i.e. as gradients of the code values.

Inputs are the compact codes of :func:`.codes.sparse_codes`: per token and head, ``topk`` coordinates (uint8 for
D <= 256) and their values. Nothing in this module ever reads a dense K (or a dense Q): a tile is rebuilt in
registers from its codes when a kernel needs it. No Tq x Tk tensor exists; each program keeps one score tile.

Forward (one program per query tile of BLOCK_M queries and query head, FlashAttention-2 style):
- densify the query tile once: ``Qd [BLOCK_M, D]`` zero-filled, in the codes' value dtype, from topk
  compare-selects;
- for each key tile of BLOCK_N keys up to the tile's last query position (causal tile skipping): densify the key
  tile from its codes the same way, transposed, ``Kd^T [D, BLOCK_N]`` (topk compare-selects over the tile), and
  ``S = Qd @ Kd^T`` with ``tl.dot`` accumulating in float32: tensor cores for 16-bit codes, whose products are exact
  in float32, so S sums exactly the products of shared coordinates (the others are products with a zero); a pair
  with no shared coordinate scores 0. In the interpreter the dot takes exact float32 products
  (:func:`..triton_common.dot`). Float32 codes keep v1's scores, k gathers of Qd columns and k FMAs per pair
  (exact float32 products of whole tiles spill on sm_90, below);
- online softmax in float32 (base 2), ``acc += P @ V`` with ``tl.dot`` (tensor cores for 16-bit V, P rounded to
  V's dtype as in FlashAttention-2);
- write the output and the float32 log-sum-exp. Only the diagonal and last key tiles carry a mask.

Backward (FlashAttention-2 with the global log-sum-exp L and ``delta_i = dO_i . O_i``; no atomics, deterministic):
- dq kernel, per query tile: recompute S exactly as the forward, ``P = exp(S - L)``, ``dP = dO V^T`` (tl.dot),
  ``dS = P (dP - delta)``; with the key tile densified transposed ``Kd^T [D, BLOCK_N]``, the code gradient
  ``dq_val[m, t] = scale * sum_n dS[m, n] Kd[n, q_idx[m, t]]`` (topk gathers and row sums);
- dk/dv kernel, per key tile and KV head, over the query heads of its group (GQA without copies): the key tile is
  densified once, ``S^T[n, m] = sum_t q_val[m, t] Kd[n, q_idx[m, t]]``, ``dV += P^T dO`` (tl.dot), and with the
  query tile densified transposed, ``dk_val[n, s] = scale * sum_m dS^T[n, m] Qd[m, k_idx[n, s]]``.
The wrapper turns ``dq_val`` / ``dk_val`` into gradients of dense q and k through the autograd of
:func:`.codes.sparse_codes` (a scatter at the kept coordinates, zero elsewhere).

Work per (query, key) pair visited, with k = topk and d = D:
- forward scores: k * d / BLOCK_M compare-selects to densify the key tiles (each key tile is densified once per
  query tile that visits it; the query tile once per program, k * d / Tk per pair) and d tensor-core MACs for S,
  against d MACs dense; P @ V: d tensor-core MACs as dense (the paper's FLOP counts also keep a dense P @ V). With
  k = 8, d = 128, BLOCK_M = 64: 16 selects and 2 * 128 MACs per pair (the measured v1 forward spent k = 8 gathers
  of a register tile per pair instead, about a hundred FMAs' time each);
- backward: 4k gathers with FMAs (S in both kernels, dq, dk) and 3d tensor-core MACs (dP in both kernels, dV),
  plus densifying the streamed tile, k * d * (1 / BLOCK_M + 1 / BLOCK_N) compare-selects; a two-kernel dense FA2
  backward spends 7d tensor-core MACs (S and dP in both kernels, dq, dk, dv).
Bytes read per key token each time a query tile visits it, 16-bit values and uint8 indices: 3k for its codes and
2d for its V row, against 4d for dense K and V rows; each query tile reads its own codes (3k per query) once.
With k = 8, d = 128: 24 + 256 bytes instead of 512. Only V, O and the codes live in memory: O(T * (k + d)).

:func:`dense_cuda_core_attention` is the like-for-like dense baseline: the same forward kernel, tiling and P @ V
with dense q and k, its scores in IEEE float32 dots over 16 coordinates at a time, which Triton lowers to FMAs on
CUDA cores (float32 tensor cores only do tf32), as the paper's FMA FlashAttention-2 baseline computes them. P @ V
stays on tensor cores: an FMA P @ V with a [BLOCK_M, D] accumulator spills kilobytes of registers per thread on
sm_90, which would measure the spills rather than the scores.

Tiles: 64 x 32 with 8 warps on CUDA, chosen by compiling for sm_90 offline (Triton 3.9, cuobjdump -res-usage).
Forward, 16-bit codes, registers per thread (spilled bytes): D = 64: 162 (0), D = 128: 218 (0), D = 256: 255 (80);
64 x 64 with 8 warps also fits (187 / 243, 0) but the backward kernels share the tiles; 128-query tiles, which halve
the selects per pair, spill at D = 128 (64 bytes with 8 warps, 300+ with 16). The key tile is densified
transposed, which Triton lays out with one key per thread column: untransposed, [BLOCK_N, D] takes 238 registers
at D = 128 and 64 x 64 tiles spill 112 bytes. Float32 codes: exact float32 products of whole [64, D] tiles would
spill about 7.6 KB per thread at D = 128, so they gather (233 registers, no spill at D = 128; 40 bytes of stack at
D = 64). The backward kernels are unchanged (no spills at D = 64 and 128, a few hundred bytes at D = 256).
In the Triton interpreter (CPU tests) 32 x 16, so short sequences span several query and key tiles, the causal
diagonal and ragged last tiles.

PREDICTION (made before the first GPU run of this version): 64K tokens, H = 8, d = 128, k = 8, bfloat16,
causal: 1.72e10 pair-heads (8 * 65536^2 / 2). The two dots, 2 * 128 MACs = 512 FLOP per pair, are 8.8e12 FLOP:
14.7 ms at 600 TFLOP/s to 22.0 ms at 400 TFLOP/s. The selects, 16 per pair, are 2.75e11: 4.6 ms at 60 T-ops/s of
CUDA-core issue (9.2 ms if a select costs a compare and a select). Not overlapped: about 19-27 ms (up to 31 ms with
two-instruction selects), i.e. 34-48x the measured CUDA-core dense kernel (928 ms) and 0.49-0.68x SDPA-cuDNN
(13.2 ms). Not counted: the softmax (also in cuDNN's time) and that Triton may lay the S dot of a 64-query tile over
both warpgroups of 8 warps (wgmma layout [8, 1]), computing it twice (dots then 13.2e12 FLOP, 22-33 ms).
MEASURED (benchmarks/results/sfa_h200/NOTES.md, v2): 113.5 ms, 8.08x the CUDA-core kernel but 0.12x SDPA-cuDNN,
4-6x the prediction; the key-tile densification is the suspect (not profiled). ``sfa_attention``'s "auto" therefore
takes the sdpa backend on CUDA, and these kernels serve what it cannot compute (softcap, log-sum-exp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..._checks import check_bool, check_qkv, check_softcap, fail, resolve_scale
from ..triton_common import dot, kernel_blocker, on_device_of, tanh
from .codes import sparse_codes

# Running maximum of an empty row: finite, so exp2(m_old - m_new) never computes inf - inf.
_EMPTY_MAX = tl.constexpr(-1.0e30)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Tiling:
    """Queries and keys per tile (forward and both backward kernels), warps and pipeline stages per program."""

    block_m: int
    block_n: int
    warps: int
    stages: int


def tiling(device: torch.device) -> Tiling:
    """The tiles of the kernels on ``device`` (module docstring: why these)."""
    if device.type == "cuda":
        return Tiling(block_m=64, block_n=32, warps=8, stages=2)
    return Tiling(block_m=32, block_n=16, warps=1, stages=1)


@triton.jit
def _densify(IDX, VAL, tok, valid, offs_d, TOPK: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
             TRANSPOSED: tl.constexpr, DTYPE: tl.constexpr):
    """The zero-filled DTYPE tile of the codes of tokens ``tok`` [ROWS] of one head (codes contiguous [T, TOPK]):
    [ROWS, D], or [D, ROWS] when TRANSPOSED; invalid tokens give zero rows. A token's coordinates are distinct, so
    selects (not sums) place the values exactly, in the values' own dtype or float32. The forward's tl.dot operands
    take the values' dtype; the backward's gathered tiles float32 (a 16-bit tile would halve its registers, yet
    spills more on sm_90: the gathers then convert it)."""
    if TRANSPOSED:
        dense = tl.zeros([HEAD_DIM, ROWS], DTYPE)
    else:
        dense = tl.zeros([ROWS, HEAD_DIM], DTYPE)
    offs = tok.to(tl.int64) * TOPK
    for s in range(TOPK):
        idx = tl.load(IDX + offs + s, mask=valid, other=0).to(tl.int32)
        val = tl.load(VAL + offs + s, mask=valid, other=0.0).to(DTYPE)
        if TRANSPOSED:
            dense = tl.where(offs_d[:, None] == idx[None, :], val[None, :], dense)
        else:
            dense = tl.where(offs_d[None, :] == idx[:, None], val[:, None], dense)
    return dense


@triton.jit
def _scores(dense, IDX, VAL, tok, valid, TOPK: tl.constexpr):
    """Unscaled float32 scores [R, C] of the R rows of ``dense`` [R, D] (zero-filled float32) with the codes of
    tokens ``tok`` [C]: ``sum_s val[c, s] * dense[r, idx[c, s]]``, one gather and one float32 FMA per slot
    (products of 16-bit values are exact in float32); invalid tokens score 0."""
    acc = tl.zeros([dense.shape[0], tok.shape[0]], tl.float32)
    offs = tok.to(tl.int64) * TOPK
    for s in range(TOPK):
        idx = tl.load(IDX + offs + s, mask=valid, other=0).to(tl.int32)
        val = tl.load(VAL + offs + s, mask=valid, other=0.0).to(tl.float32)
        acc += tl.gather(dense, tl.broadcast_to(idx[None, :], acc.shape), 1) * val[None, :]
    return acc


@triton.jit
def _code_grads(ds, dense_t, IDX, tok, valid, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr):
    """[R, TOPK_POW2] float32: ``sum_c ds[r, c] * dense_t[idx[r, t], c]`` in column t < TOPK (0 beyond), the
    gradient of the code values of the R row tokens ``tok`` given the score gradients ``ds`` [R, C] and the other
    side's zero-filled tile transposed, ``dense_t`` [D, C]."""
    slots = tl.arange(0, TOPK_POW2)
    grads = tl.zeros([ds.shape[0], TOPK_POW2], tl.float32)
    offs = tok.to(tl.int64) * TOPK
    for t in range(TOPK):
        idx = tl.load(IDX + offs + t, mask=valid, other=0).to(tl.int32)
        picked = tl.gather(dense_t, tl.broadcast_to(idx[:, None], ds.shape), 0)
        grads = tl.where(slots[None, :] == t, tl.sum(ds * picked, 1)[:, None], grads)
    return grads


@triton.jit
def _allowed(q_pos, k_pos, k_len, CAUSAL: tl.constexpr):
    """Pairs that attend, for broadcastable query and key positions: real keys, at or before the query if causal."""
    allowed = k_pos < k_len
    if CAUSAL:
        allowed = allowed & (k_pos <= q_pos)
    return allowed


@triton.jit
def _key_ranges(start_m, q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(mid, hi) for the query tile at ``start_m``: key tiles in [0, mid) are attended by all its queries (no mask),
    those in [mid, hi) need the mask, keys from hi on are never visited (causal: after the tile's last query)."""
    if CAUSAL:
        first = start_m + k_len - q_len  # key position of the tile's first query
        hi = tl.minimum(first + BLOCK_M, k_len)
        mid = tl.minimum(first + 1, k_len) // BLOCK_N * BLOCK_N
    else:
        hi = k_len
        mid = k_len // BLOCK_N * BLOCK_N
    return mid, hi


@triton.jit
def _query_ranges(start_n, q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(lo, mid) for the key tile at ``start_n``: query tiles before lo attend none of its keys (never visited),
    those in [lo, mid) need the causal mask, those from mid on attend all its keys. Query rows past q_len read
    zero codes and dO, so they add exactly nothing unmasked; key rows past k_len are never stored."""
    if CAUSAL:
        offset = k_len - q_len
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        # the first query tile whose first query sits at or after the tile's last key
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), tl.cdiv(q_len, BLOCK_M) * BLOCK_M)
    else:
        lo = 0
        mid = 0
    return lo, mid


@triton.jit
def _logits(raw, scale, softcap, SOFTCAP: tl.constexpr):
    """(logits in log2 units, d logit / d (scale * raw)) of raw scores; softcap: softcap * tanh(x / softcap), which
    keeps a zero-overlap pair at 0."""
    x = raw * scale
    # One return statement: the compiler checks every return of a function alike, even one under a false constexpr.
    if SOFTCAP:
        t = tanh(x / softcap)
        x = softcap * t
        dcap = 1.0 - t * t
    else:
        dcap = 1.0
    return x * 1.4426950408889634, dcap


@triton.jit
def _dense_scores(Q, K, rows, q_valid, keys, k_valid, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Unscaled scores [M, N] of dense query rows and key rows of one head ([T, D] contiguous) on CUDA cores: IEEE
    float32 dots, which Triton lowers to FMAs, over CHUNK coordinates at a time (whole [M, D] FMA operands spill
    registers on sm_90)."""
    offs = tl.arange(0, CHUNK)
    raw = tl.zeros([rows.shape[0], keys.shape[0]], tl.float32)
    for d0 in range(0, HEAD_DIM, CHUNK):
        q = tl.load(Q + rows.to(tl.int64)[:, None] * HEAD_DIM + d0 + offs[None, :], mask=q_valid[:, None], other=0.0)
        k = tl.load(K + keys.to(tl.int64)[:, None] * HEAD_DIM + d0 + offs[None, :], mask=k_valid[:, None], other=0.0)
        raw += dot(q, tl.trans(k), False)
    return raw


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, rows, q_valid, q_pos, K0, K1, V, k_len, lo, hi, scale, softcap, offs_d,
               BLOCK_N: tl.constexpr, TOPK: tl.constexpr, HEAD_DIM: tl.constexpr, SPARSE: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr):
    """Online-softmax steps of the query tile ``rows`` over the key tiles in [lo, hi) of one KV head. SPARSE: q is
    the zero-filled query tile [M, D] in the codes' dtype and K0, K1 the key codes (indices, values); otherwise q
    and K0 point to the head's dense queries and keys."""
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_valid = keys < k_len
        if SPARSE and K1.dtype.element_ty == tl.float32:
            # Exact float32 products of whole [M, D] x [D, N] tiles spill kilobytes of registers per thread on
            # sm_90: float32 codes gather their k products per pair instead, as the backward does.
            raw = _scores(q, K0, K1, keys, k_valid, TOPK)
        elif SPARSE:
            raw = dot(q, _densify(K0, K1, keys, k_valid, offs_d, TOPK, BLOCK_N, HEAD_DIM, True, K1.dtype.element_ty),
                      NATIVE)
        else:
            raw = _dense_scores(q, K0, rows, q_valid, keys, k_valid, HEAD_DIM, 16)
        s, _ = _logits(raw, scale, softcap, SOFTCAP)
        if MASKED:
            s = tl.where(_allowed(q_pos[:, None], keys[None, :], k_len, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + keys.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], mask=k_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, NATIVE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q0, Q1, K0, K1, V, O, LSE, q_len, k_len, scale, softcap,
                GQA: tl.constexpr, TOPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SPARSE: tl.constexpr, SOFTCAP: tl.constexpr,
                NATIVE: tl.constexpr):
    """Grid (query tiles, B * Hq). SPARSE: Q0, Q1 / K0, K1 are the codes (indices, values) [B, H, T, TOPK];
    otherwise Q0 and K0 are dense q and k [B, H, T, D] (Q1, K1 unused). V [B, Hkv, Tk, D]; writes O [B, Hq, Tq, D]
    and LSE [B, Hq, Tq] (float32, natural log). All contiguous."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # b * Hq + h; its KV head is b * Hkv + h // GQA = bh // GQA
    offs_d = tl.arange(0, HEAD_DIM)
    rows = start_m + tl.arange(0, BLOCK_M)
    q_valid = rows < q_len
    if SPARSE:
        q = _densify(Q0 + bh * q_len * TOPK, Q1 + bh * q_len * TOPK, rows, q_valid, offs_d, TOPK, BLOCK_M, HEAD_DIM,
                     False, Q1.dtype.element_ty)
        k0 = K0 + (bh // GQA) * k_len * TOPK
        k1 = K1 + (bh // GQA) * k_len * TOPK
    else:
        q = Q0 + bh * q_len * HEAD_DIM
        k0 = K0 + (bh // GQA) * k_len * HEAD_DIM
        k1 = k0
    v = V + (bh // GQA) * k_len * HEAD_DIM
    q_pos = rows + (k_len - q_len)

    m_i = tl.full([BLOCK_M], _EMPTY_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    mid, hi = _key_ranges(start_m, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, rows, q_valid, q_pos, k0, k1, v, k_len, 0, mid, scale, softcap,
                               offs_d, BLOCK_N, TOPK, HEAD_DIM, SPARSE, False, CAUSAL, SOFTCAP, NATIVE)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, rows, q_valid, q_pos, k0, k1, v, k_len, mid, hi, scale, softcap,
                               offs_d, BLOCK_N, TOPK, HEAD_DIM, SPARSE, True, CAUSAL, SOFTCAP, NATIVE)

    # A row with no attended key keeps l_i = 0: output 0 and log-sum-exp -inf (the package's convention).
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(O + bh * q_len * HEAD_DIM + rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=q_valid[:, None])
    tl.store(LSE + bh * q_len + rows, lse, mask=q_valid)


@triton.jit
def _dq_steps(dq, qd, do, lse, delta, q_pos, rows, q_valid, QI, KI, KV, V, k_len, lo, hi, scale, softcap, offs_d,
              BLOCK_N: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr):
    """Code-gradient steps of one query tile over the key tiles in [lo, hi); lse in log2 units. Adds
    ``dL/d(scale * raw) * Kd[n, q_idx[m, t]]`` summed over the keys (the caller multiplies by scale)."""
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_valid = keys < k_len
        s, dcap = _logits(_scores(qd, KI, KV, keys, k_valid, TOPK), scale, softcap, SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_allowed(q_pos[:, None], keys[None, :], k_len, CAUSAL), p, 0.0)
        v = tl.load(V + keys.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], mask=k_valid[:, None], other=0.0)
        ds = p * (dot(do, tl.trans(v), NATIVE) - delta[:, None]) * dcap
        kd_t = _densify(KI, KV, keys, k_valid, offs_d, TOPK, BLOCK_N, HEAD_DIM, True, tl.float32)
        dq += _code_grads(ds, kd_t, QI, rows, q_valid, TOPK, TOPK_POW2)
    return dq


@triton.jit
def _bwd_dq_kernel(QI, QV, KI, KV, V, DO, LSE, DELTA, DQ, q_len, k_len, scale, softcap,
                   GQA: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                   NATIVE: tl.constexpr):
    """Grid (query tiles, B * Hq). Writes DQ [B, Hq, Tq, TOPK] (float32): the gradient of the query code values."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = start_m + tl.arange(0, BLOCK_M)
    q_valid = rows < q_len
    qi = QI + bh * q_len * TOPK
    qd = _densify(qi, QV + bh * q_len * TOPK, rows, q_valid, offs_d, TOPK, BLOCK_M, HEAD_DIM, False, tl.float32)
    do = tl.load(DO + bh * q_len * HEAD_DIM + rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                 mask=q_valid[:, None], other=0.0)
    lse = tl.load(LSE + bh * q_len + rows, mask=q_valid, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * q_len + rows, mask=q_valid, other=0.0)
    ki = KI + (bh // GQA) * k_len * TOPK
    kv = KV + (bh // GQA) * k_len * TOPK
    v = V + (bh // GQA) * k_len * HEAD_DIM
    q_pos = rows + (k_len - q_len)

    dq = tl.zeros([BLOCK_M, TOPK_POW2], tl.float32)
    mid, hi = _key_ranges(start_m, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_steps(dq, qd, do, lse, delta, q_pos, rows, q_valid, qi, ki, kv, v, k_len, 0, mid, scale, softcap, offs_d,
                   BLOCK_N, TOPK, TOPK_POW2, HEAD_DIM, False, CAUSAL, SOFTCAP, NATIVE)
    dq = _dq_steps(dq, qd, do, lse, delta, q_pos, rows, q_valid, qi, ki, kv, v, k_len, mid, hi, scale, softcap,
                   offs_d, BLOCK_N, TOPK, TOPK_POW2, HEAD_DIM, True, CAUSAL, SOFTCAP, NATIVE)
    slots = tl.arange(0, TOPK_POW2)
    tl.store(DQ + bh * q_len * TOPK + rows.to(tl.int64)[:, None] * TOPK + slots[None, :], dq * scale,
             mask=q_valid[:, None] & (slots[None, :] < TOPK))


@triton.jit
def _dkdv_steps(dk, dv, kd, v, keys, k_valid, KI, QI, QV, DO, LSE, DELTA, q_len, k_len, lo, hi, scale, softcap,
                offs_d, BLOCK_M: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr):
    """Steps of one key tile over the query tiles in [lo, hi) of one query head, in transposed [keys, queries]
    tiles."""
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q_valid = rows < q_len
        lse = tl.load(LSE + rows, mask=q_valid, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + rows, mask=q_valid, other=0.0)
        s_t, dcap_t = _logits(_scores(kd, QI, QV, rows, q_valid, TOPK), scale, softcap, SOFTCAP)
        p_t = tl.exp2(s_t - lse[None, :])
        if MASKED:
            p_t = tl.where(_allowed(rows[None, :] + (k_len - q_len), keys[:, None], k_len, CAUSAL), p_t, 0.0)
        do = tl.load(DO + rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], mask=q_valid[:, None], other=0.0)
        dv += dot(p_t.to(do.dtype), do, NATIVE)
        ds_t = p_t * (dot(v, tl.trans(do), NATIVE) - delta[None, :]) * dcap_t
        qd_t = _densify(QI, QV, rows, q_valid, offs_d, TOPK, BLOCK_M, HEAD_DIM, True, tl.float32)
        dk += _code_grads(ds_t, qd_t, KI, keys, k_valid, TOPK, TOPK_POW2)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(QI, QV, KI, KV, V, DO, LSE, DELTA, DK, DV, q_len, k_len, scale, softcap,
                     GQA: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                     NATIVE: tl.constexpr):
    """Grid (key tiles, B * Hkv). Sums over the GQA query heads of the KV head; writes DK [B, Hkv, Tk, TOPK]
    (float32, the gradient of the key code values) and DV [B, Hkv, Tk, D] (V's dtype)."""
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1).to(tl.int64)  # b * Hkv + kv head; its query heads are bkv * GQA + g
    offs_d = tl.arange(0, HEAD_DIM)
    keys = start_n + tl.arange(0, BLOCK_N)
    k_valid = keys < k_len
    ki = KI + bkv * k_len * TOPK
    kd = _densify(ki, KV + bkv * k_len * TOPK, keys, k_valid, offs_d, TOPK, BLOCK_N, HEAD_DIM, False, tl.float32)
    v_ptrs = bkv * k_len * HEAD_DIM + keys.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    v = tl.load(V + v_ptrs, mask=k_valid[:, None], other=0.0)

    dk = tl.zeros([BLOCK_N, TOPK_POW2], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo, mid = _query_ranges(start_n, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL)
    for g in range(GQA):
        bh = bkv * GQA + g
        qi = QI + bh * q_len * TOPK
        qv = QV + bh * q_len * TOPK
        do = DO + bh * q_len * HEAD_DIM
        dk, dv = _dkdv_steps(dk, dv, kd, v, keys, k_valid, ki, qi, qv, do, LSE + bh * q_len, DELTA + bh * q_len,
                             q_len, k_len, lo, mid, scale, softcap, offs_d, BLOCK_M, TOPK, TOPK_POW2, HEAD_DIM, True,
                             CAUSAL, SOFTCAP, NATIVE)
        dk, dv = _dkdv_steps(dk, dv, kd, v, keys, k_valid, ki, qi, qv, do, LSE + bh * q_len, DELTA + bh * q_len,
                             q_len, k_len, mid, q_len, scale, softcap, offs_d, BLOCK_M, TOPK, TOPK_POW2, HEAD_DIM,
                             False, CAUSAL, SOFTCAP, NATIVE)
    slots = tl.arange(0, TOPK_POW2)
    tl.store(DK + bkv * k_len * TOPK + keys.to(tl.int64)[:, None] * TOPK + slots[None, :], dk * scale,
             mask=k_valid[:, None] & (slots[None, :] < TOPK))
    tl.store(DV + v_ptrs, dv.to(DV.dtype.element_ty), mask=k_valid[:, None])


def _native(t: torch.Tensor) -> bool:
    """Whether the tensor-core dots take t's dtype as it is (see :func:`..triton_common.dot`): 16-bit inputs on a
    GPU; float32 inputs and the interpreter use exact float32 products."""
    return t.dtype != torch.float32 and t.device.type == "cuda"


def _written_dtype(t: torch.Tensor) -> torch.dtype:
    """Dtype in which the kernels write t's outputs: t's own on a GPU. The interpreter truncates float32 ->
    bfloat16 casts (Triton 3.9; the GPU rounds to nearest even), which would double the outputs' rounding error, so
    there the kernels write float32 and torch rounds."""
    return t.dtype if t.device.type == "cuda" else torch.float32


def _forward(q_idx, q_val, k_idx, k_val, v, causal: bool, scale: float, softcap: Optional[float]):
    """Launch the sparse forward kernel on contiguous codes and v; returns (out [B, Hq, Tq, D], lse float32)."""
    batch, q_heads, q_len, topk = q_idx.shape
    kv_heads, k_len, dim = v.shape[1:]
    tiles = tiling(v.device)
    out = torch.empty(batch, q_heads, q_len, dim, dtype=_written_dtype(v), device=v.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=v.device)
    with on_device_of(v):
        _fwd_kernel[(triton.cdiv(q_len, tiles.block_m), batch * q_heads)](
            q_idx, q_val, k_idx, k_val, v, out, lse, q_len, k_len, scale, softcap or 1.0, GQA=q_heads // kv_heads,
            TOPK=topk, HEAD_DIM=dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal, SPARSE=True,
            SOFTCAP=softcap is not None, NATIVE=_native(v), num_warps=tiles.warps, num_stages=tiles.stages)
    return out.to(v.dtype), lse


def _backward(q_idx, q_val, k_idx, k_val, v, out, lse, grad_out, grad_lse, causal: bool, scale: float,
              softcap: Optional[float]):
    """Launch the two backward kernels; returns the gradients of q_val, k_val (their dtypes) and v. ``grad_out``
    and ``grad_lse`` (either may be None: that output unused) are the gradients of out and lse; d lse_i / d s_ij
    = P_ij, so the lse's folds into each row's delta."""
    batch, q_heads, q_len, topk = q_idx.shape
    kv_heads, k_len, dim = v.shape[1:]
    tiles = tiling(v.device)
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    dq_val = torch.empty(q_idx.shape, dtype=torch.float32, device=v.device)
    dk_val = torch.empty(k_idx.shape, dtype=torch.float32, device=v.device)
    dv = torch.empty(v.shape, dtype=_written_dtype(v), device=v.device)
    args = (q_len, k_len, scale, softcap or 1.0)
    meta = dict(GQA=q_heads // kv_heads, TOPK=topk, TOPK_POW2=triton.next_power_of_2(topk), HEAD_DIM=dim,
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal, SOFTCAP=softcap is not None,
                NATIVE=_native(v), num_warps=tiles.warps, num_stages=tiles.stages)
    with on_device_of(v):
        _bwd_dq_kernel[(triton.cdiv(q_len, tiles.block_m), batch * q_heads)](
            q_idx, q_val, k_idx, k_val, v, grad_out, lse, delta, dq_val, *args, **meta)
        _bwd_dkdv_kernel[(triton.cdiv(k_len, tiles.block_n), batch * kv_heads)](
            q_idx, q_val, k_idx, k_val, v, grad_out, lse, delta, dk_val, dv, *args, **meta)
    return dq_val.to(q_val.dtype), dk_val.to(k_val.dtype), dv.to(v.dtype)


class _FlashSFA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, q_val, k_idx, k_val, v, causal, scale, softcap):
        out, lse = _forward(q_idx, q_val, k_idx, k_val, v, causal, scale, softcap)
        ctx.save_for_backward(q_idx, q_val, k_idx, k_val, v, out, lse)
        ctx.settings = (causal, scale, softcap)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        dq_val, dk_val, dv = _backward(*ctx.saved_tensors, grad_out, grad_lse, *ctx.settings)
        return None, dq_val, None, dk_val, dv, None, None, None


def _check_codes(q_idx, q_val, k_idx, k_val, v) -> None:
    """Shapes and dtypes of :func:`sfa_attention_from_codes`'s arguments (not the index values: see there)."""
    for name, t in (("q_idx", q_idx), ("q_val", q_val), ("k_idx", k_idx), ("k_val", k_val), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            fail(name, "a 4-d tensor", getattr(t, "shape", type(t).__name__))
    for name, t in (("q_idx", q_idx), ("k_idx", k_idx)):
        if t.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
            fail(name, "uint8, int16, int32 or int64 coordinates", t.dtype)
    if v.dtype not in _DTYPES:
        fail("v", "a float16, bfloat16 or float32 tensor", v.dtype)
    if q_val.dtype != v.dtype or k_val.dtype != v.dtype:
        fail("q_val, k_val", f"the dtype of v ({v.dtype})", f"q_val {q_val.dtype}, k_val {k_val.dtype}")
    if q_idx.shape != q_val.shape or k_idx.shape != k_val.shape:
        fail("q_idx, k_idx", "the shapes of q_val and k_val", f"{tuple(q_idx.shape)}, {tuple(k_idx.shape)}")
    batch, kv_heads, k_len, dim = v.shape
    if k_idx.shape[:3] != (batch, kv_heads, k_len):
        fail("k_idx", f"[B, Hkv, Tk, topk] = [{batch}, {kv_heads}, {k_len}, topk] (v's first three dims)",
             tuple(k_idx.shape))
    q_batch, q_heads, q_len, topk = q_idx.shape
    if q_batch != batch or q_heads % kv_heads or not 1 <= q_len <= k_len or k_idx.shape[3] != topk:
        fail("q_idx", f"[B={batch}, Hq (a multiple of {kv_heads}), 1 <= Tq <= {k_len}, topk of k_idx]",
             tuple(q_idx.shape))
    if not 1 <= topk <= dim:
        fail("q_idx", f"1 to D = {dim} coordinates per token", topk)
    if dim < 16 or dim > 256 or dim & (dim - 1):
        fail("v", "a head dim that is a power of two in [16, 256]", dim)
    if len({t.device for t in (q_idx, q_val, k_idx, k_val, v)}) != 1:
        fail("q_idx, q_val, k_idx, k_val, v", "one device", [str(t.device) for t in (q_idx, q_val, k_idx, k_val, v)])
    blocker = kernel_blocker(v)
    if blocker:
        fail("q_val, k_val, v", "tensors the FlashSFA kernels can take", blocker)


def sfa_attention_from_codes(q_idx: torch.Tensor, q_val: torch.Tensor, k_idx: torch.Tensor, k_val: torch.Tensor,
                             v: torch.Tensor, *, causal: bool = True, scale: Optional[float] = None,
                             softcap: Optional[float] = None):
    """SFA attention from the sparse codes of q and k, through the FlashSFA kernels (never a dense q or k).

    Args:
        q_idx, q_val: [B, Hq, Tq, topk] codes of the queries per query head (:func:`.codes.sparse_codes`): integer
            coordinates in [0, D), distinct per token (not checked: the kernels trust them), and their values.
        k_idx, k_val: [B, Hkv, Tk, topk] codes of the keys per KV head; Hq % Hkv == 0; the same topk as q.
        v: dense [B, Hkv, Tk, D], D a power of two in [16, 256]; q_val, k_val and v share one float dtype
            (float16, bfloat16 or float32).
        causal: query i sits at key position Tk - Tq + i (1 <= Tq <= Tk) and attends keys at or before it.
        scale: logit scale, default 1/sqrt(D). softcap: logits become softcap * tanh(logit / softcap).

    The logit of (i, j) is scale * sum over the coordinates both codes hold of q_val * k_val (then the softcap);
    then softmax and P.V, as :func:`.reference.sfa_attention_reference` on the densified codes.

    Returns out [B, Hq, Tq, D] (dtype of v) and lse [B, Hq, Tq] (float32, natural log), both differentiable in
    q_val, k_val and v.
    """
    _check_codes(q_idx, q_val, k_idx, k_val, v)
    scale = resolve_scale(scale, v.shape[-1])
    codes = (t.contiguous() for t in (q_idx, q_val, k_idx, k_val, v))
    return _FlashSFA.apply(*codes, check_bool("causal", causal), scale, check_softcap(softcap))


def flash_sfa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, topk: int, causal: bool,
                        scale: float, softcap: Optional[float] = None):
    """SFA attention of dense q, k, v (as validated by :func:`.attention.sfa_attention`) through FlashSFA: the
    codes come from :func:`.codes.sparse_codes` (the selection rule every SFA path shares), q per query head and
    k once per KV head. Returns (out, lse float32); gradients reach q and k at their kept coordinates only."""
    q_idx, q_val = sparse_codes(q, topk)
    k_idx, k_val = sparse_codes(k, topk)
    return sfa_attention_from_codes(q_idx, q_val, k_idx, k_val, v, causal=causal, scale=scale, softcap=softcap)


def dense_cuda_core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                              scale: Optional[float] = None):
    """Dense attention through the FlashSFA forward kernel's tiling with its dots on CUDA cores (IEEE float32
    FMAs, no tensor cores): the like-for-like baseline of the paper's speed comparison. Forward only.

    q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D], Hq % Hkv == 0, Tq <= Tk (queries aligned to the end of the keys),
    float16, bfloat16 or float32, D a power of two in [16, 256]. Returns (out [B, Hq, Tq, D] in q's dtype, lse
    [B, Hq, Tq] float32)."""
    check_qkv(q, k, v)
    blocker = kernel_blocker(q)
    if blocker:
        fail("q", "tensors the FlashSFA kernels can take", blocker)
    batch, q_heads, q_len, dim = q.shape
    kv_heads, k_len = k.shape[1:3]
    q, k, v = (t.contiguous() for t in (q, k, v))
    tiles = tiling(q.device)
    out = torch.empty(q.shape, dtype=_written_dtype(q), device=q.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    with on_device_of(q):
        _fwd_kernel[(triton.cdiv(q_len, tiles.block_m), batch * q_heads)](
            q, q, k, k, v, out, lse, q_len, k_len, resolve_scale(scale, dim), 1.0, GQA=q_heads // kv_heads, TOPK=1,
            HEAD_DIM=dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=check_bool("causal", causal), SPARSE=False,
            SOFTCAP=False, NATIVE=_native(v), num_warps=tiles.warps, num_stages=tiles.stages)
    return out.to(q.dtype), lse
