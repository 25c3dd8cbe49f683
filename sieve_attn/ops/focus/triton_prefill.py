"""Triton kernels of hard Focus attention for prefill and training (``backend="triton"``), forward and backward.

The pattern is computed as its two disjoint pair sets (see :mod:`.layout`): the window set in position order, then
the group set over the tokens sorted by group. Each costs dense attention on its own tiles only: a query reads its
window plus the earlier members of its groups, never the whole sequence.

Forward: the window kernel writes a float32 partial (output, log-sum-exp) per query; the group kernel starts each
query's online softmax from that partial (so the merge costs no extra pass) and writes the final output. A token
with several memberships has one copy per group; copies of rank >= 1 write extra partials that are merged by
log-sum-exp afterwards (:func:`sieve_attn.ops.merge.merge_extra_partials`).

Backward: with the final output O and log-sum-exp L of every query, a pair's gradient depends only on that pair:
dS_ij = P_ij (dO_i . v_j - dO_i . O_i) with P_ij = exp(s_ij - L_i). So each pair set (and each copy) runs a plain
FlashAttention-2 backward over its own tiles with the global L and delta_i = dO_i . O_i, and adds dq, dk, dv
atomically in float32 (tokens are scattered in the group layout; the sum order is not deterministic).

K and V are read per KV head (GQA, MQA) and never copied per query head; the sorted layout is read through
token indices, so nothing is gathered into a copy either.

:class:`WindowSet` runs the window set alone, for the decomposition backend (:mod:`.decomposed`), which computes
the group set with SDPA calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..merge import merge_extra_partials
from ..triton_common import dot, on_device_of, tanh
from .decomposed import PlanAttention
from .layout import group_layout, window_layout

# Running maximum of an empty row: finite, so exp2(m_old - m_new) never computes inf - inf.
_EMPTY_MAX = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class Tiling:
    """Tile sizes: ``layout`` slots per layout tile; forward query x key tiles (the window set's query tiles are
    ``window_m``); backward tiles (dq and dk/dv). ``longest_first``: the forward and dq kernels take their query
    tiles in reverse, so that a causal segment's last tiles, which walk the most key steps, start first and short
    ones fill the tail of the launch (the dk/dv kernel's first key tiles walk the most queries already). H200, v17
    (top-1, CUDA graphs, side by side): the forward even at 8K, 3-6% faster from 16K (64K K=8 3.36 vs 3.49 ms)."""

    layout: int
    fwd_m: int
    window_m: int
    fwd_n: int
    bwd: int
    fwd_warps: int
    bwd_warps: int
    fwd_stages: int
    bwd_stages: int
    longest_first: bool = True

    def __post_init__(self):
        # A query tile's key steps end at its own end, and its tiles fill a layout tile: each size divides the next.
        for small, large in ((self.fwd_n, self.fwd_m), (self.fwd_n, self.window_m), (self.fwd_m, self.layout),
                             (self.window_m, self.layout), (self.bwd, self.layout)):
            assert large % small == 0, f"tile sizes: {large} is not a multiple of {small} ({self})"


def tiling(device: torch.device) -> Tiling:
    """Tiles measured best on the H200 (benchmarks/results/focus_h200/NOTES.md: fwd 128 x 64 with 4 warps, bwd 64 x 64
    with 4 warps). The window set's query tiles are 64 rows: it has only 3 to 4 key steps per tile, so it gains from
    more programs per SM (v13: 0.30 against 0.53 ms at 64K tokens, 8 heads) where the long group loops do not. In the
    interpreter small tiles that still exercise several key steps per query tile and several sub-tiles per layout
    tile."""
    if device.type == "cuda":
        return Tiling(layout=128, fwd_m=128, window_m=64, fwd_n=64, bwd=64, fwd_warps=4, bwd_warps=4, fwd_stages=3,
                      bwd_stages=2)
    return Tiling(layout=32, fwd_m=32, window_m=16, fwd_n=16, bwd=16, fwd_warps=4, bwd_warps=4, fwd_stages=1,
                  bwd_stages=1)


@triton.jit
def _pair_mask(q_tok, k_tok, q_bits, k_bits, lower, window, WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr,
               MULTI: tl.constexpr):
    """Pairs of the set among broadcastable query/key token indices (-1 = padding) and group bit sets."""
    allowed = (q_tok >= 0) & (k_tok >= 0)
    if WINDOW_SET:
        distance = q_tok - k_tok
        allowed = allowed & (distance >= 0) & (distance <= window) & ((q_bits & k_bits) == 0)
    else:
        if CAUSAL:
            allowed = allowed & (k_tok <= q_tok)
        if MULTI:  # count a pair only in the lowest group the two tokens share
            allowed = allowed & ((q_bits & k_bits & lower) == 0)
    return allowed


@triton.jit
def _logits(products, scale, softcap, SOFTCAP: tl.constexpr):
    """(logits in log2 units, d logit / d raw logit) for the dot products q.k of a tile."""
    # One return: Triton cannot compile a constexpr branch that returns values of another type (float vs tensor).
    logits = products * scale
    slope = tl.full(logits.shape, 1.0, tl.float32)
    if SOFTCAP:
        t = tanh(logits / softcap)
        logits = softcap * t
        slope = 1.0 - t * t
    return logits * 1.4426950408889634, slope


@triton.jit
def _rows(base, tok, stride_t, offs_d):
    """[len(tok), D] rows of one head, zero for padding slots."""
    ptrs = base + tl.maximum(tok, 0).to(tl.int64)[:, None] * stride_t + offs_d[None, :]
    return tl.load(ptrs, mask=(tok >= 0)[:, None], other=0.0)


@triton.jit
def _tile_tokens(SLOT_TOKEN, TILE_BATCH, TILE_LOWER, BITS, s_bits, start, LAYOUT: tl.constexpr, BLOCK: tl.constexpr):
    """The sub-tile of BLOCK slots at ``start``: (layout tile, sequence, lower-group bits, token indices, the
    sequence's bit-set row, the tokens' bit sets)."""
    tile = start // LAYOUT
    b = tl.load(TILE_BATCH + tile).to(tl.int64)
    tok = tl.load(SLOT_TOKEN + start + tl.arange(0, BLOCK))
    bits_row = BITS + b * s_bits
    return tile, b, tl.load(TILE_LOWER + tile), tok, bits_row, tl.load(bits_row + tl.maximum(tok, 0))


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, BITS_ROW, lower, lo, hi, s_kt, s_vt,
               window, scale, softcap, offs_d, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr, MULTI: tl.constexpr, SOFTCAP: tl.constexpr,
               NATIVE: tl.constexpr):
    """Online-softmax steps over key slots [lo, hi). Unmasked steps (MASKED false) hold real, earlier keys of the
    queries' group: only the lowest-shared-group rule applies there, and only with several memberships."""
    q_low = q_bits & lower  # the queries' groups below this one
    for start in range(lo, hi, BLOCK_N):
        k_tok = tl.load(SLOT_TOKEN + start + tl.arange(0, BLOCK_N))
        k = _rows(k_base, k_tok, s_kt, offs_d)
        v = _rows(v_base, k_tok, s_vt, offs_d)
        s, _ = _logits(dot(q, tl.trans(k), NATIVE), scale, softcap, SOFTCAP)
        if MASKED:
            k_bits = tl.load(BITS_ROW + tl.maximum(k_tok, 0))
            allowed = _pair_mask(q_tok[:, None], k_tok[None, :], q_bits[:, None], k_bits[None, :], lower, window,
                                 WINDOW_SET, CAUSAL, MULTI)
            s = tl.where(allowed, s, float("-inf"))
        elif MULTI:
            k_bits = tl.load(BITS_ROW + tl.maximum(k_tok, 0))
            s = tl.where((q_low[:, None] & k_bits[None, :]) == 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, NATIVE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _tile_start(BLOCK: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """First slot of the program's query tile of BLOCK slots: the tiles in reverse with LONGEST_FIRST."""
    tile = tl.program_id(0)
    if LONGEST_FIRST:
        tile = tl.num_programs(0) - 1 - tile
    return tile * BLOCK


@triton.jit
def _key_range(TILE_SEG_START, TILE_SEG_END, tile, q_start, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr):
    """Key slots [lo, hi) read by the query sub-tile at slot q_start: ``window`` positions back (window set), the
    segment up to the sub-tile (causal), or the whole segment."""
    lo = tl.load(TILE_SEG_START + tile)
    hi = tl.load(TILE_SEG_END + tile)
    if WINDOW_SET:
        lo = tl.maximum(lo, tl.maximum(q_start - window, 0) // BLOCK_N * BLOCK_N)
    if WINDOW_SET or CAUSAL:
        hi = q_start + BLOCK_M
    return lo, hi


@triton.jit
def _query_range(TILE_SEG_START, TILE_SEG_END, tile, k_start, window, BLOCK: tl.constexpr,
                 WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr):
    """Query slots [lo, hi) that read the key sub-tile at slot k_start (the mirror of :func:`_key_range`)."""
    lo = tl.load(TILE_SEG_START + tile)
    hi = tl.load(TILE_SEG_END + tile)
    if WINDOW_SET or CAUSAL:
        lo = k_start
    if WINDOW_SET:
        hi = tl.minimum(hi, (k_start + BLOCK + window + BLOCK - 1) // BLOCK * BLOCK)
    return lo, hi


@triton.jit
def _fwd_kernel(Q, K, V, BITS, SLOT_TOKEN, SLOT_EXTRA, TILE_BATCH, TILE_LOWER, TILE_SEG_START, TILE_SEG_END,
                INIT_O, INIT_LSE, O, LSE, EXTRA_O, EXTRA_LSE,
                s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ot, s_ib, s_ih, s_it,
                s_bits, num_heads, length, window, scale, softcap,
                GQA: tl.constexpr, HEAD_DIM: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr, MULTI: tl.constexpr,
                HAS_INIT: tl.constexpr, SOFTCAP: tl.constexpr, NATIVE: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    q_start = _tile_start(BLOCK_M, LONGEST_FIRST)
    head = tl.program_id(1).to(tl.int64)  # head x head stride passes 2**31 in large tensors (32 heads x 1M x 128)
    tile, b, lower, q_tok, bits_row, q_bits = _tile_tokens(SLOT_TOKEN, TILE_BATCH, TILE_LOWER, BITS, s_bits, q_start,
                                                           LAYOUT, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_slots = q_start + tl.arange(0, BLOCK_M)
    q = _rows(Q + b * s_qb + head * s_qh, q_tok, s_qt, offs_d)
    k_base = K + b * s_kb + (head // GQA) * s_kh
    v_base = V + b * s_vb + (head // GQA) * s_vh
    stats = LSE + b * (num_heads * length) + head * length

    m_i = tl.full([BLOCK_M], _EMPTY_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    extra = tl.load(SLOT_EXTRA + q_slots)
    if HAS_INIT:  # rank-0 copies continue from the other pair set's partial result
        init_tok = tl.where(extra < 0, q_tok, -1)
        init_lse = tl.load(INIT_LSE + b * (num_heads * length) + head * length + tl.maximum(init_tok, 0),
                           mask=init_tok >= 0, other=float("-inf"))
        has = init_lse > float("-inf")
        m_i = tl.where(has, init_lse * 1.4426950408889634, m_i)
        l_i = tl.where(has, 1.0, l_i)
        acc = _rows(INIT_O + b * s_ib + head * s_ih, tl.where(has, init_tok, -1), s_it, offs_d).to(tl.float32)

    lo, hi = _key_range(TILE_SEG_START, TILE_SEG_END, tile, q_start, window, BLOCK_M, BLOCK_N, WINDOW_SET, CAUSAL)
    if WINDOW_SET or not CAUSAL:
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, bits_row, lower,
                                   lo, hi, s_kt, s_vt, window, scale, softcap, offs_d, BLOCK_N, True,
                                   WINDOW_SET, CAUSAL, MULTI, SOFTCAP, NATIVE)
    else:  # keys before the sub-tile are earlier real members of the group: at most the lowest-group rule
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, bits_row, lower,
                                   lo, q_start, s_kt, s_vt, window, scale, softcap, offs_d, BLOCK_N, False,
                                   WINDOW_SET, CAUSAL, MULTI, SOFTCAP, NATIVE)
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, bits_row, lower,
                                   q_start, hi, s_kt, s_vt, window, scale, softcap, offs_d, BLOCK_N, True,
                                   WINDOW_SET, CAUSAL, MULTI, SOFTCAP, NATIVE)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    final = (q_tok >= 0) & (extra < 0)
    o_ptrs = O + b * s_ob + head * s_oh + tl.maximum(q_tok, 0).to(tl.int64)[:, None] * s_ot + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=final[:, None])
    tl.store(stats + tl.maximum(q_tok, 0), lse, mask=final)
    if MULTI:
        is_extra = (q_tok >= 0) & (extra >= 0)
        row = tl.maximum(extra, 0).to(tl.int64) * num_heads + head
        tl.store(EXTRA_O + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=is_extra[:, None])
        tl.store(EXTRA_LSE + row, lse, mask=is_extra)


@triton.jit
def _dq_steps(dq, q, do, lse, delta, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, BITS_ROW, lower, lo, hi, s_kt,
              s_vt, window, scale, softcap, offs_d, BLOCK: tl.constexpr, MASKED: tl.constexpr,
              WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr, MULTI: tl.constexpr, SOFTCAP: tl.constexpr,
              NATIVE: tl.constexpr):
    q_low = q_bits & lower
    for start in range(lo, hi, BLOCK):
        k_tok = tl.load(SLOT_TOKEN + start + tl.arange(0, BLOCK))
        k = _rows(k_base, k_tok, s_kt, offs_d)
        v = _rows(v_base, k_tok, s_vt, offs_d)
        s, dcap = _logits(dot(q, tl.trans(k), NATIVE), scale, softcap, SOFTCAP)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            k_bits = tl.load(BITS_ROW + tl.maximum(k_tok, 0))
            allowed = _pair_mask(q_tok[:, None], k_tok[None, :], q_bits[:, None], k_bits[None, :], lower, window,
                                 WINDOW_SET, CAUSAL, MULTI)
            p = tl.where(allowed, p, 0.0)
        elif MULTI:
            k_bits = tl.load(BITS_ROW + tl.maximum(k_tok, 0))
            p = tl.where((q_low[:, None] & k_bits[None, :]) == 0, p, 0.0)
        ds = p * (dot(do, tl.trans(v), NATIVE) - delta[:, None]) * dcap
        dq += dot(ds.to(k.dtype), k, NATIVE)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, BITS, SLOT_TOKEN, TILE_BATCH, TILE_LOWER, TILE_SEG_START, TILE_SEG_END,
                   s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_db, s_dh, s_dt,
                   s_bits, num_heads, length, window, scale, softcap,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, LAYOUT: tl.constexpr, BLOCK: tl.constexpr,
                   WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr, MULTI: tl.constexpr, SOFTCAP: tl.constexpr,
                   NATIVE: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    q_start = _tile_start(BLOCK, LONGEST_FIRST)
    head = tl.program_id(1).to(tl.int64)
    tile, b, lower, q_tok, bits_row, q_bits = _tile_tokens(SLOT_TOKEN, TILE_BATCH, TILE_LOWER, BITS, s_bits, q_start,
                                                           LAYOUT, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _rows(Q + b * s_qb + head * s_qh, q_tok, s_qt, offs_d)
    do = _rows(DO + b * s_db + head * s_dh, q_tok, s_dt, offs_d)
    row_stats = b * (num_heads * length) + head * length + tl.maximum(q_tok, 0)
    lse = tl.load(LSE + row_stats, mask=q_tok >= 0, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_stats, mask=q_tok >= 0, other=0.0)
    k_base = K + b * s_kb + (head // GQA) * s_kh
    v_base = V + b * s_vb + (head // GQA) * s_vh

    dq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    lo, hi = _key_range(TILE_SEG_START, TILE_SEG_END, tile, q_start, window, BLOCK, BLOCK, WINDOW_SET, CAUSAL)
    if WINDOW_SET or not CAUSAL:
        dq = _dq_steps(dq, q, do, lse, delta, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, bits_row, lower, lo, hi,
                       s_kt, s_vt, window, scale, softcap, offs_d, BLOCK, True, WINDOW_SET, CAUSAL, MULTI,
                       SOFTCAP, NATIVE)
    else:
        dq = _dq_steps(dq, q, do, lse, delta, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, bits_row, lower, lo,
                       q_start, s_kt, s_vt, window, scale, softcap, offs_d, BLOCK, False, WINDOW_SET, CAUSAL,
                       MULTI, SOFTCAP, NATIVE)
        dq = _dq_steps(dq, q, do, lse, delta, q_tok, q_bits, k_base, v_base, SLOT_TOKEN, bits_row, lower,
                       q_start, hi, s_kt, s_vt, window, scale, softcap, offs_d, BLOCK, True, WINDOW_SET, CAUSAL,
                       MULTI, SOFTCAP, NATIVE)
    ptrs = DQ + b * s_qb + head * s_qh + tl.maximum(q_tok, 0).to(tl.int64)[:, None] * s_qt + offs_d[None, :]
    tl.atomic_add(ptrs, dq * scale, mask=(q_tok >= 0)[:, None])


@triton.jit
def _dkdv_steps(dk, dv, k, v, k_tok, k_bits, q_base, do_base, LSE_ROW, DELTA_ROW, SLOT_TOKEN, BITS_ROW, lower, lo, hi,
                s_qt, s_dt, window, scale, softcap, offs_d, BLOCK: tl.constexpr, MASKED: tl.constexpr,
                WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr, MULTI: tl.constexpr, SOFTCAP: tl.constexpr,
                NATIVE: tl.constexpr):
    """Steps over query slots [lo, hi); padding queries load q = dO = 0 and contribute nothing unmasked."""
    k_low = k_bits & lower  # the keys' groups below this one
    for start in range(lo, hi, BLOCK):
        q_tok = tl.load(SLOT_TOKEN + start + tl.arange(0, BLOCK))
        q = _rows(q_base, q_tok, s_qt, offs_d)
        do = _rows(do_base, q_tok, s_dt, offs_d)
        lse = tl.load(LSE_ROW + tl.maximum(q_tok, 0), mask=q_tok >= 0, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA_ROW + tl.maximum(q_tok, 0), mask=q_tok >= 0, other=0.0)
        s_t, dcap_t = _logits(dot(k, tl.trans(q), NATIVE), scale, softcap, SOFTCAP)  # [keys, queries]
        p_t = tl.exp2(s_t - lse[None, :])
        if MASKED:
            q_bits = tl.load(BITS_ROW + tl.maximum(q_tok, 0))
            allowed = _pair_mask(q_tok[None, :], k_tok[:, None], q_bits[None, :], k_bits[:, None], lower, window,
                                 WINDOW_SET, CAUSAL, MULTI)
            p_t = tl.where(allowed, p_t, 0.0)
        elif MULTI:
            q_bits = tl.load(BITS_ROW + tl.maximum(q_tok, 0))
            p_t = tl.where((k_low[:, None] & q_bits[None, :]) == 0, p_t, 0.0)
        dv += dot(p_t.to(do.dtype), do, NATIVE)
        ds_t = p_t * (dot(v, tl.trans(do), NATIVE) - delta[None, :]) * dcap_t
        dk += dot(ds_t.to(q.dtype), q, NATIVE)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, BITS, SLOT_TOKEN, TILE_BATCH, TILE_LOWER, TILE_SEG_START,
                     TILE_SEG_END, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_db, s_dh, s_dt,
                     s_bits, num_heads, length, window, scale, softcap,
                     GQA: tl.constexpr, HEAD_DIM: tl.constexpr, LAYOUT: tl.constexpr, BLOCK: tl.constexpr,
                     WINDOW_SET: tl.constexpr, CAUSAL: tl.constexpr, MULTI: tl.constexpr, SOFTCAP: tl.constexpr,
                     NATIVE: tl.constexpr):
    k_start = tl.program_id(0) * BLOCK
    kv_head = tl.program_id(1).to(tl.int64)
    tile, b, lower, k_tok, bits_row, k_bits = _tile_tokens(SLOT_TOKEN, TILE_BATCH, TILE_LOWER, BITS, s_bits, k_start,
                                                           LAYOUT, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _rows(K + b * s_kb + kv_head * s_kh, k_tok, s_kt, offs_d)
    v = _rows(V + b * s_vb + kv_head * s_vh, k_tok, s_vt, offs_d)

    lo, hi = _query_range(TILE_SEG_START, TILE_SEG_END, tile, k_start, window, BLOCK, WINDOW_SET, CAUSAL)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    for g in range(GQA):
        head = kv_head * GQA + g
        q_base = Q + b * s_qb + head * s_qh
        do_base = DO + b * s_db + head * s_dh
        stats = b * (num_heads * length) + head * length
        if WINDOW_SET or not CAUSAL:
            dk, dv = _dkdv_steps(dk, dv, k, v, k_tok, k_bits, q_base, do_base, LSE + stats, DELTA + stats,
                                 SLOT_TOKEN, bits_row, lower, lo, hi, s_qt, s_dt, window, scale, softcap, offs_d,
                                 BLOCK, True, WINDOW_SET, CAUSAL, MULTI, SOFTCAP, NATIVE)
        else:  # queries after the sub-tile are later members of the group: at most the lowest-group rule
            dk, dv = _dkdv_steps(dk, dv, k, v, k_tok, k_bits, q_base, do_base, LSE + stats, DELTA + stats,
                                 SLOT_TOKEN, bits_row, lower, lo, k_start + BLOCK, s_qt, s_dt, window, scale,
                                 softcap, offs_d, BLOCK, True, WINDOW_SET, CAUSAL, MULTI, SOFTCAP, NATIVE)
            dk, dv = _dkdv_steps(dk, dv, k, v, k_tok, k_bits, q_base, do_base, LSE + stats, DELTA + stats,
                                 SLOT_TOKEN, bits_row, lower, k_start + BLOCK, hi, s_qt, s_dt, window, scale,
                                 softcap, offs_d, BLOCK, False, WINDOW_SET, CAUSAL, MULTI, SOFTCAP, NATIVE)
    rows = tl.maximum(k_tok, 0).to(tl.int64)[:, None] * s_kt + offs_d[None, :]
    valid = (k_tok >= 0)[:, None]
    tl.atomic_add(DK + b * s_kb + kv_head * s_kh + rows, dk * scale, mask=valid)
    tl.atomic_add(DV + b * s_kb + kv_head * s_kh + rows, dv, mask=valid)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


class _Kernels:
    """The settings every launch of one call shares, and the launches over one pair set's layout."""

    def __init__(self, bits, num_groups, batch, length, kv_heads, window, causal, scale, softcap, device):
        self.tiles = tiling(device)
        self.kv_heads = kv_heads
        # With ids < 31 the bit sets fit 32-bit integers, whose masks cost half the instructions of 64-bit ones.
        self.bits_dtype = torch.int32 if num_groups <= 31 else torch.int64
        self.bits = bits.to(self.bits_dtype).contiguous()
        self.window_layout = window_layout(batch, length, self.tiles.layout, device, self.bits_dtype)
        self.window, self.causal, self.scale = window, causal, scale
        self.softcap = softcap

    def _launch_forward(self, layout, window_set, multi, q, k, v, init, out, lse, extra=None):
        """One forward pass over ``layout``'s tiles into ``out`` [B, Hq, T, D] (any strides) and ``lse`` [B, Hq, T]
        (contiguous). ``init`` = (out, lse) of the same shapes, or None: each query's softmax starts from it (a query
        with init lse -inf starts empty). ``extra`` = (out [E, Hq, D], lse [E, Hq]) float32 for the copies of rank
        >= 1 (``multi``)."""
        heads = q.shape[1]
        if extra is None:
            extra = (out.new_empty(1, heads, q.shape[3], dtype=torch.float32),
                     lse.new_empty(1, heads, dtype=torch.float32))
        init_out, init_lse = init if init is not None else (out, lse)  # unread without init
        block_m = self.tiles.window_m if window_set else self.tiles.fwd_m
        _fwd_kernel[(layout.num_tiles * self.tiles.layout // block_m, heads)](
            q, k, v, self.bits, layout.slot_token, layout.slot_extra, layout.tile_batch, layout.tile_lower,
            layout.tile_seg_start, layout.tile_seg_end, init_out, init_lse, out, lse, *extra,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(init_out), *self._scalars(q),
            HAS_INIT=init is not None, LONGEST_FIRST=self.tiles.longest_first,
            BLOCK_M=block_m, BLOCK_N=self.tiles.fwd_n, num_warps=self.tiles.fwd_warps,
            num_stages=self.tiles.fwd_stages, **self._meta(q, window_set, multi))

    def _launch_backward(self, layout, window_set, multi, q, k, v, grad_out, lse, delta, dq, dk, dv):
        """Adds one pair set's share of the gradients into ``dq``, ``dk``, ``dv`` (float32, the shapes and strides of
        the contiguous ``q``, ``k``, ``v``), given the final ``lse`` and ``delta`` = rowsum(dO * O), [B, Hq, T]."""
        tiles = self.tiles
        meta = dict(BLOCK=tiles.bwd, num_warps=tiles.bwd_warps, num_stages=tiles.bwd_stages,
                    **self._meta(q, window_set, multi))
        tables = (self.bits, layout.slot_token, layout.tile_batch, layout.tile_lower, layout.tile_seg_start,
                  layout.tile_seg_end)
        strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))
        programs = layout.num_tiles * tiles.layout // tiles.bwd
        _bwd_dq_kernel[(programs, q.shape[1])](q, k, v, grad_out, lse, delta, dq, *tables, *strides,
                                               *self._scalars(q), LONGEST_FIRST=tiles.longest_first, **meta)
        _bwd_dkdv_kernel[(programs, k.shape[1])](q, k, v, grad_out, lse, delta, dk, dv, *tables, *strides,
                                                 *self._scalars(q), **meta)

    def _meta(self, q, window_set, multi):
        return dict(GQA=q.shape[1] // self.kv_heads, HEAD_DIM=q.shape[3], LAYOUT=self.tiles.layout,
                    WINDOW_SET=window_set, CAUSAL=self.causal, MULTI=multi, SOFTCAP=self.softcap is not None,
                    NATIVE=q.dtype != torch.float32 and q.device.type == "cuda")

    def _scalars(self, q):
        return (self.bits.stride(0), q.shape[1], q.shape[2], self.window, self.scale, self.softcap or 1.0)


def _backward_inputs(q, k, v, out, grad_out, grads=None, grad_lse=None):
    """Contiguous q, k, v, dO; delta = rowsum(dO * O) - dlse [B, Hq, T] float32 (``grad_lse``: the gradient of the
    returned lse, None for none: d lse_i / d s_ij = P_ij folds into the row's delta); ``grads`` (float32 dq, dk, dv
    to add into, made contiguous) or zeros."""
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)
    delta = (delta if grad_lse is None else delta - grad_lse.float()).contiguous()
    if grads is None:
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]
    return (*(t.contiguous() for t in (q, k, v)), grad_out, delta, [g.contiguous() for g in grads])


class WindowSet(_Kernels):
    """The window set alone (local pairs that share no group), for a backend that computes the group set otherwise
    (:mod:`.decomposed` on CUDA). ``bits`` [B, T] are the tokens' group bit sets (ids < ``num_groups`` <= 63)."""

    def forward(self, q, k, v, dtype=torch.float32):
        """The window set's partial result: (out [B, Hq, T, D] in ``dtype``, laid out token-major ([B, T, Hq, D] in
        memory), lse [B, Hq, T] float32); a query none of whose window keys is in the set (the first token, say)
        gets out 0 and lse -inf."""
        batch, heads, length, dim = q.shape
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = torch.empty(batch, length, heads, dim, dtype=dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(batch, heads, length, dtype=torch.float32, device=q.device)
        self._launch_forward(self.window_layout, True, False, q, k, v, None, out, lse)
        return out, lse

    def backward(self, q, k, v, out, lse, grad_out, grads=None):
        """The window set's share of (dq, dk, dv), float32 [B, H, T, D], from the final ``out`` and ``lse``; added
        into ``grads`` (float32, the shapes of q, k, v; the other set's share) when given, and returned."""
        q, k, v, grad_out, delta, grads = _backward_inputs(q, k, v, out, grad_out, grads)
        self._launch_backward(self.window_layout, True, False, q, k, v, grad_out, lse.contiguous(), delta, *grads)
        return grads


class _Pattern(_Kernels):
    """Both pair sets: the plan of a :class:`~.decomposed.PlanAttention` for the Triton backend. Forward: the window
    kernel writes a float32 partial, the group kernel continues from it and writes the output. Its lse carries
    gradient."""

    lse_has_gradient = True

    def __init__(self, groups, bits, num_groups, batch, length, kv_heads, window, causal, scale, softcap, device):
        super().__init__(bits, num_groups, batch, length, kv_heads, window, causal, scale, softcap, device)
        self.group_layout = group_layout(groups, bits, self.tiles.layout, num_groups, self.bits_dtype)
        self.multi = self.group_layout.num_extra > 0
        self.slots = groups.shape[2]  # two: each token has at most one extra copy

    def sets(self):
        """(layout, WINDOW_SET, MULTI) of the two pair sets, window first."""
        return ((self.window_layout, True, False), (self.group_layout, False, self.multi))

    def forward(self, q, k, v):
        batch, heads, length, dim = q.shape
        grp = self.group_layout
        partial = torch.empty(batch, heads, length, dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(batch, heads, length, dtype=torch.float32, device=q.device)
        self._launch_forward(self.window_layout, True, False, q, k, v, None, partial, partial_lse)
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, length, dtype=torch.float32, device=q.device)
        extra = (torch.empty(max(grp.num_extra, 1), heads, dim, dtype=torch.float32, device=q.device),
                 torch.empty(max(grp.num_extra, 1), heads, dtype=torch.float32, device=q.device))
        self._launch_forward(grp, False, self.multi, q, k, v, (partial, partial_lse), out, lse, extra)
        if self.multi:
            merge_extra_partials(out, lse, *extra, grp.extra_batch, grp.extra_token, one_per_row=self.slots == 2)
        return out, lse

    def backward(self, q, k, v, out, lse, grad_out, grad_lse=None):
        q, k, v, grad_out, delta, grads = _backward_inputs(q, k, v, out, grad_out, grad_lse=grad_lse)
        for layout, window_set, multi in self.sets():
            self._launch_backward(layout, window_set, multi, q, k, v, grad_out, lse, delta, *grads)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def focus_attention_triton(q, k, v, groups, bits, *, num_groups, window, causal, scale, softcap=None):
    """Hard Focus attention through the Triton kernels. Arguments as validated by
    :func:`sieve_attn.ops.focus.attention.focus_attention`, with Tq == Tk, group ids < 63, ``bits`` = their
    :func:`~sieve_attn.ops.focus.reference.group_bits` [B, T], ids < ``num_groups`` <= 63 and D a power of two
    in [16, 256].

    Returns (out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] float32). Gradients flow to q, k, v from both.
    """
    with on_device_of(q):  # the backward's launches run where autograd sets the device: q's
        pattern = _Pattern(groups, bits, num_groups, q.shape[0], q.shape[2], k.shape[1], window, causal, scale,
                           softcap, q.device)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return PlanAttention.apply(q, k, v, pattern)


def backward_of_pattern(groups, q, k, v, out, lse, grad_out, *, window, causal, scale):
    """(dq, dk, dv) in the inputs' dtypes of hard Focus attention without softcap, from its final ``out`` and
    ``lse``, whatever computed them (the decomposition's inclusion-exclusion forward): the Triton kernels' backward
    over both pair sets, each pair once, float32 sums. ``groups``: a
    :class:`~sieve_attn.ops.focus.groups.FocusGroups` with bit sets; the other arguments as in
    :func:`focus_attention_triton`."""
    pattern = _Pattern(groups.ids, groups.bits, groups.num_groups, q.shape[0], q.shape[2], k.shape[1], window,
                       causal, scale, None, q.device)
    return pattern.backward(q, k, v, out, lse, grad_out)  # it makes its inputs contiguous
