"""Triton decode kernel of the hard Focus pattern: a few new queries against a long KV cache.

Flash-decoding split-K (:mod:`sieve_attn.ops.split_k`): one program per (batch, KV head, chunk of keys, row block),
K and V read once per KV head. A program works in two passes over its chunk:

1. Compaction: it streams the chunk's group bit sets in steps of SCAN_N keys, tests them against the positions of
   its rows (one position at Tq = 1: the pattern depends on a row's position, not its head), appends the positions
   of the keys some row attends to its own list (int32, in a scratch buffer of ``chunk_keys`` entries per program;
   in position order, so the pass writes each list entry once, through a prefix sum of the tile's flags), and has
   L2 prefetch the K and V rows of the first listed keys.
2. Attention: it walks that list in tiles of BLOCK_N positions, gathers those K and V rows, recomputes each row's
   exact pair mask from the positions, and runs the online softmax (both dots on tiles of attended keys, all full
   but the last).

Why two passes: v4 (one pass, measured on an H200) loaded K/V rows under the mask but still ran every tile of the
chunk through both dots and the softmax. With K = 8 groups and two memberships a query attends about 3/8 of the
cache, so 5/8 of the tiles' work was wasted and the step took 1.25x the time of dense decode at 128K (0.173 vs
0.139 ms; benchmarks/results/focus_h200/NOTES.md). The list makes the work, not just the bytes, follow the attended
keys.

Bytes read: 8 bytes of ``bits`` per cached token and KV head (repeats across heads are usually served by L2), plus
the K and V rows of attended keys only, each once per KV head and row block (one row block unless the KV head's
query rows, G x Tq, exceed 64); the lists (4 bytes per attended key, written and read back) stay in L2.
"""
from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from ..._checks import fail
from .. import split_k
from ..split_k import program_rows, store_rows
from ..triton_common import (LOG2E, allow_next_kernel, dot, is_interpreted, on_device_of, prefetch_rows_l2,
                             softmax_finish, softmax_start, softmax_step, tanh)

# Plan of the two-pass kernel: the fastest that passed the gated bench on an H200 (128K, GQA 32/8, D = 128, K = 8,
# CUDA graphs). v7 (benchmarks/results/focus_h200/v7): 2 stages against 3 in the same session, top-1 0.088 vs 0.102
# ms, top-2 0.127 vs 0.143 ms. 8 warps, 32- and 128-key tiles were slower at D = 128 (v5; ``_block_n``). v9: at 156
# registers an SM holds 3 programs, and 6 per SM (two whole waves) beat 8 (top-1 0.077 vs 0.088 ms, top-2 0.126 vs
# 0.141), 3, 4, 9 and 12. v16, with the 256-key scan: 6 per SM still beat 3, 4, 8, 9 and 12 (top-1 0.056 vs
# 0.061-0.071 ms). v8 (keys-major tiles, 3 stages): 6 still beat 8 and 10 (top-1 0.051 vs 0.057 and 0.060 ms,
# top-2 0.097 vs 0.106 and 0.112). Stages: ``_num_stages``. v23 (the one-position scan; ../v23/call_c, 8K-128K, D =
# 128 and 64, gated, 5 interleaved rounds): one wave of the 3 programs an SM holds beat two waves (6 per SM) wherever
# a chunk stayed within about 21 tiles (D = 128 up to 64K: 64K top-1 0.0236 vs 0.0289 ms, top-2 0.0499 vs 0.0536,
# 32K 0.0185 vs 0.0221, 0.0331 vs 0.0355; D = 64 up to 128K: 0.0249 vs 0.0265, 0.0515 vs 0.0532) and lost at 128K,
# D = 128 (41 tiles a chunk: 0.0467 vs 0.0385, 0.1033 vs 0.0843); 4 per SM lost everywhere. So one wave, and as
# many whole waves as keep a chunk within _MAX_CHUNK_TILES tiles (split_k.plan). Call D, that plan against 6 per SM
# at any chunk length: even at 128K (0.0384, 0.0836 ms at a bound of 24 or 32), ahead below (64K 0.0234 vs 0.0290,
# 0.0494 vs 0.0531; D = 64, 128K 0.0249 vs 0.0267), behind at 256K (bound 32: 0.0625 vs 0.0619, 0.1475 vs 0.1457;
# 24: 0.0638, 0.1500; 16 lost from 64K on). Longer caches are not measured.
_NUM_WARPS, _PROGRAMS_PER_SM, _MAX_CHUNK_TILES = 4, 3, 32
# Pass 1 (the scan of the chunk's bit sets): keys per step, a power of two, and its software pipeline's stages (1:
# none, each step waits for its own load). The list it writes, and so the output, depend on neither. v15-v16
# (benchmarks/results/focus_h200/v15, v16; 128K, D = 128, K=8, CUDA graphs, ms): 64 keys unpipelined, as measured
# before, top-1 0.076 ms, top-2 0.126 (combinations) / 0.115 (adjacent); 256 keys in 3 stages 0.057, 0.106, 0.095;
# 512 in 3 stages 0.054, 0.104, 0.092 (call M). 128 keys were slower than 64 unpipelined.
_SCAN_N, _SCAN_STAGES = 512, 3
# Listed keys whose K and V rows each program has L2 prefetch during pass 1, as the scan finds them: DRAM would
# otherwise idle while the scan reads only the bit sets (8 bytes a key against 4 * D for the K and V rows in bf16).
_PREFETCH_KEYS = 64


def _block_n(head_dim: int) -> int:
    """Keys per attention tile. v16 (the plan re-swept with the 512-key scan; 128K, K=8, CUDA graphs, 6 programs
    per SM): at D = 64 128-key tiles beat 64-key ones (top-1 0.039 vs 0.047 ms, top-2 0.070 vs 0.098 on the
    combinations groups, 0.063 vs 0.086 adjacent; with 64-key tiles, 4 programs per SM reached 0.044 / 0.082 / 0.073
    and 3 stages 0.041 / 0.078 / 0.070; 128-key tiles were timed at 6 and 9 per SM only); at D = 128 they lost
    (0.063 vs 0.056 ms top-1, 0.114 vs 0.106 top-2, 256-key scan). Head dims 16, 32 (128-key tiles) and 256 are
    not measured. Side by side at D = 64 (v17, call R): even at an 8K cache (top-1 0.0197 vs 0.0194 ms with 64-key
    tiles; a chunk there is one tile of 128 keys, mostly masked), ahead at 32K (0.024 vs 0.027, top-2 0.032 vs
    0.038)."""
    return 128 if head_dim <= 64 else 64


def _num_stages(head_dim: int, itemsize: int) -> int:
    """Software-pipeline stages of the attention tiles for a cache of ``itemsize``-byte elements. v17 (call R, bf16,
    128K, K=8, CUDA graphs, 6 programs per SM, side by side): at D = 64, 128-key tiles, 3 stages beat 2 (top-1 0.038
    vs 0.039 ms, top-2 0.067 vs 0.071 on the combinations groups, 0.060 vs 0.063 adjacent); at D = 128, 64-key
    tiles, 2 beat 3 (0.055 vs 0.058 ms top-1, 0.104 vs 0.111 top-2, 0.093 vs 0.099 adjacent), as in v7. With
    keys-major tiles (v8, ../sfa_h200/v8, call B; 123-155 registers) 3 beat 2 at D = 128 too: top-1 0.051 vs 0.055
    ms, top-2 0.097 vs 0.106 (6 programs per SM; 2 stages at 8 per SM 0.055 and 0.099). A float32 cache keeps 2
    (not timed with 3): a third stage would add 64 KiB of staged K and V tiles at D = 64, which the shared memory of
    GPUs before Hopper (about 100 KiB per SM) may not hold."""
    return 3 if itemsize <= 2 else 2


@triton.jit
def _focus_decode_chunk(
    Q, K, V, BITS, KEYS, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_bits_b, stride_bits_t,
    kv_heads, group, q_len, k_len, window, scale, softcap, chunk_keys, num_chunks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN_N: tl.constexpr,
    SCAN_M: tl.constexpr, SCAN_STAGES: tl.constexpr, PREFETCH_KEYS: tl.constexpr, SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    """Grid (B * Hkv, chunks, row blocks). KEYS: int32 scratch, ``chunk_keys`` entries per program. Writes the
    chunk's normalized output and log-sum-exp of each row to O [B, Hq, Tq, chunks, D] and LSE [B, Hq, Tq, chunks]
    (contiguous; chunks = 1 writes the final tensors). ``scale`` and ``softcap`` come times log2 e: the logits are
    in base 2 for softmax_step, and softcap * tanh(s / softcap) commutes with that factor."""
    b, kv_head, r, row_ok, q_pos, d, q, _, start, stop = program_rows(
        Q, stride_qb, stride_qh, stride_qt, stride_qd, kv_heads, group, q_len, k_len, chunk_keys, BLOCK_M, HEAD_DIM)
    bits_row = BITS + b * stride_bits_b
    q_bits = tl.load(bits_row + q_pos * stride_bits_t, mask=row_ok, other=0)
    program = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    keys = KEYS + program.to(tl.int64) * chunk_keys
    k_head = K + b * stride_kb + kv_head * stride_kh
    v_head = V + b * stride_vb + kv_head * stride_vh

    # Pass 1: the positions of the chunk's keys that some row attends, in position order, SCAN_N keys per step.
    # The pattern depends on a row's position only, so the scan tests SCAN_M positions that include all of the
    # rows' (row r sits at query r % Tq; SCAN_M >= min(Tq, BLOCK_M) consecutive rows cover each position a block
    # holds, repeats aside): one position at Tq = 1 instead of BLOCK_M rows.
    scan_pos = k_len - q_len + (tl.program_id(2) * BLOCK_M + tl.arange(0, SCAN_M)) % q_len
    scan_bits = tl.load(bits_row + scan_pos * stride_bits_t)
    scan_ok = tl.full([SCAN_M], 1, tl.int1)
    count = 0
    for n0 in tl.range(start, stop, SCAN_N, num_stages=SCAN_STAGES):
        n = n0 + tl.arange(0, SCAN_N)
        needed = tl.max(_pairs(n, n < stop, bits_row, stride_bits_t, scan_pos, scan_bits, scan_ok, window)
                        .to(tl.int32), axis=1) > 0
        flags = needed.to(tl.int32)
        slot = count + tl.cumsum(flags, axis=0) - flags
        tl.store(keys + slot, n, mask=needed)
        if PREFETCH_KEYS > 0:
            if count < PREFETCH_KEYS:
                # The first PREFETCH_KEYS listed keys; the others ask for row start (in bounds, and one line).
                rows = tl.where(needed & (slot < PREFETCH_KEYS), n, start)
                prefetch_rows_l2(k_head, rows, stride_kt, stride_kd, HEAD_DIM)
                prefetch_rows_l2(v_head, rows, stride_vt, stride_vd, HEAD_DIM)
        count += tl.sum(flags, axis=0)
    # The list is written by all of the program's threads and read by all of them: the barrier orders those global
    # stores before the loads (bar.sync orders the CTA's memory accesses).
    tl.debug_barrier()

    # Pass 2: the online softmax over the listed keys.
    q_t = tl.trans(q)
    acc_t, l_t, m_i = softmax_start(BLOCK_M, HEAD_DIM, BLOCK_N)
    for t0 in range(0, count, BLOCK_N):
        listed = t0 + tl.arange(0, BLOCK_N) < count
        # .cg: through L2, where pass 1 stored (the barrier already orders the stores before these loads). Positions
        # times strides stay int32, which focus_decode checks: int64 offsets (with 2 stages) measured 12-22% slower
        # (NOTES v6).
        n = tl.load(keys + t0 + tl.arange(0, BLOCK_N), mask=listed, other=0, cache_modifier=".cg")
        pair = _pairs(n, listed, bits_row, stride_bits_t, q_pos, q_bits, row_ok, window)
        k = tl.load(k_head + n[:, None] * stride_kt + d[None, :] * stride_kd, mask=listed[:, None], other=0.0)
        v_t = tl.load(v_head + n[None, :] * stride_vt + d[:, None] * stride_vd, mask=listed[None, :], other=0.0)
        s = dot(k, q_t, NATIVE_DOT) * scale  # [BLOCK_N, BLOCK_M], keys-major as softmax_step takes them
        if SOFTCAP:
            s = softcap * tanh(s / softcap)
        acc_t, l_t, m_i = softmax_step(acc_t, l_t, m_i, tl.where(pair, s, float("-inf")), v_t, NATIVE_DOT)

    allow_next_kernel()  # the merge (a programmatic dependent launch where the GPU can)
    out, lse = softmax_finish(acc_t, l_t, m_i)
    store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM)


@triton.jit
def _pairs(n, key_ok, bits_row, stride_bits_t, q_pos, q_bits, row_ok, window):
    """[BLOCK_N, BLOCK_M] bool, keys-major: which of the keys at positions ``n`` [BLOCK_N] (those with ``key_ok``)
    the program's rows attend: causal, and local (0 <= i - j <= window) or sharing a group."""
    k_bits = tl.load(bits_row + n * stride_bits_t, mask=key_ok, other=0)
    distance = q_pos[None, :] - n[:, None]
    # Causal (distance >= 0) also drops the keys past the cache end: every query sits before k_len.
    return (key_ok[:, None] & row_ok[None, :] & (distance >= 0)
            & ((distance <= window) | ((k_bits[:, None] & q_bits[None, :]) != 0)))


_INTERPRETED = is_interpreted(_focus_decode_chunk)


def focus_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, *, window: int,
                 scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard-group Focus attention of a few decode queries against the whole KV cache (Triton).

    Args:
        q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] (the cache, new tokens included), Hq % Hkv == 0; query head h reads
            KV head h // (Hq // Hkv). One float dtype (float16, bfloat16 or float32), D in {16, 32, 64, 128, 256}, any
            strides whose offsets within one head, (Tk - 1) * stride(2) + (D - 1) * stride(3), stay below 2**31
            (the kernel's int32 offsets; ValueError otherwise). Tq is small (decode steps); query i sits at key
            position Tk - Tq + i.
        bits: int64 [B, Tk], each token's group bit set (:func:`~sieve_attn.ops.focus.reference.group_bits`).
        window: key j is local to query i when 0 <= i - j <= window.
        scale: logits are scale * q.k in float32. softcap: logits become softcap * tanh(logit / softcap).

    Pair (i, j) is attended iff j <= i and (i - j <= window or bits[b, i] & bits[b, j] != 0), exactly as
    :func:`~sieve_attn.ops.focus.reference.focus_attention_reference` with ``causal=True``. Logits,
    softmax and accumulation are float32; the probabilities enter P @ V rounded to V's dtype, as in FlashAttention
    (:func:`..triton_common.softmax_step`).

    Returns out [B, Hq, Tq, D] (dtype of q) and lse [B, Hq, Tq] (float32, natural log). A row with no attended key
    (impossible here: j = i is always local) would get 0 and -inf, as in FlashAttention.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    assert q_heads % kv_heads == 0 and 1 <= q_len <= k_len and head_dim in (16, 32, 64, 128, 256)
    assert k.dtype == v.dtype == q.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert bits.dtype == torch.int64 and bits.shape == (batch, k_len)
    for name, t in (("k", k), ("v", v)):
        if (k_len - 1) * t.stride(2) + (head_dim - 1) * t.stride(3) >= 2 ** 31:
            fail(name, "strides whose offsets within one KV head fit int32 ((Tk - 1) * stride(2) + (D - 1) * "
                       "stride(3) < 2**31; a contiguous [B, Hkv, Tk, D] cache does up to 16M tokens at D = 128)",
                 f"strides {t.stride()} at Tk = {k_len}")
    block_n = _block_n(head_dim)
    plan = partial(split_k.plan, batch, q_heads, kv_heads, q_len, k_len, q.device, block_n=block_n,
                   max_chunk_tiles=_MAX_CHUNK_TILES)
    work = plan(programs_per_sm=_PROGRAMS_PER_SM)
    options = dict(HEAD_DIM=head_dim, BLOCK_M=work.block_m, BLOCK_N=block_n, SCAN_N=_SCAN_N,
                   SCAN_M=triton.next_power_of_2(min(q_len, work.block_m)), SCAN_STAGES=_SCAN_STAGES,
                   PREFETCH_KEYS=_PREFETCH_KEYS, SOFTCAP=softcap is not None,
                   NATIVE_DOT=q.dtype != torch.float32 and not _INTERPRETED, num_warps=_NUM_WARPS,
                   num_stages=_num_stages(head_dim, q.element_size()))

    def arguments(keys, part_out, part_lse, work):
        return (q, k, v, bits, keys, part_out, part_lse,
                *q.stride(), *k.stride(), *v.stride(), *bits.stride(),
                kv_heads, q_heads // kv_heads, q_len, k_len, min(window, k_len), scale * LOG2E,
                (1.0 if softcap is None else softcap) * LOG2E, work.chunk_keys, work.chunks)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    with on_device_of(q):
        partial_dtype = q.dtype if work.chunks == 1 else torch.float32  # one chunk writes the output itself
        signature = arguments(torch.int32, partial_dtype, torch.float32, work)
        held = split_k.programs_per_sm(_focus_decode_chunk, signature, options, q.device, _PROGRAMS_PER_SM)
        if held < _PROGRAMS_PER_SM:
            work = plan(programs_per_sm=held)
        part_out, part_lse = (out, lse) if work.chunks == 1 else split_k.partials(q, work.chunks)
        programs = batch * kv_heads * work.chunks * work.row_blocks
        keys = torch.empty(programs * work.chunk_keys, dtype=torch.int32, device=q.device)
        _focus_decode_chunk[(batch * kv_heads, work.chunks, work.row_blocks)](
            *arguments(keys, part_out, part_lse, work), **options)
        if work.chunks > 1:
            split_k.merge(part_out, part_lse, out, lse)
    return out, lse
