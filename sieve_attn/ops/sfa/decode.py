"""SFA decode step: a few new queries against the compressed key cache (:class:`.cache.SFAKeyCache`).

The queries are sparsified per query head with the rule every SFA path shares (:mod:`.codes`); the score of a query
and a cached key is ``scale * sum over the coordinates both keep of q~_u * k~_u``, then causal softmax and P.V with
the dense cached V: exactly :func:`.reference.sfa_attention_reference` (q, K, V, causal=True) where K are the dense
keys the cache was built from. Two backends compute it:

- ``reference``: plain PyTorch. Unpacks and densifies the cached keys one block at a time (never the whole cache)
  and runs an online softmax over the blocks.
- ``triton``: flash-decoding split-K (:mod:`sieve_attn.ops.split_k`), bound by the bytes of the cache. One launch
  sparsifies the queries into a table (:func:`sparse_query_table`) that puts the G * Tq query rows of a KV head (G =
  Hq / Hkv) side by side under each coordinate; then one program per (batch, KV head, chunk of keys) takes all of
  them, so every code and every V row is read from memory once; on long caches the keys past the chunks (at least a
  tenth; a twentieth from topk = 16) are a pool that the programs take over as they finish their chunks, in units
  that shrink to single tiles as it drains (:func:`_sfa_decode_chunk`, :mod:`.pool`). The score tile is [keys,
  rows], one key per thread: the thread reads its key's packed indices as the 4-byte words that hold them
  (:func:`_index_word`) and its values as 8-byte words, and per code t < topk one vector load fetches the rows'
  table entries at index t (8 bytes at 4 bfloat16 rows; the table, 1 KiB, stays in L1): score = scale * sum_t
  q~[idx_t] * val_t, the dot of the sparse query with the densified key, which is never built. The tile stays
  keys-major through the online softmax (base 2, denominators in per-slot partial sums) and P @ V, issued as V^T @
  P^T on tensor cores (:func:`..triton_common.softmax_step`); the V tile comes through the TMA copy engine where the
  GPU has one. The chunks' partials merge by log-sum-exp (:func:`..split_k.merge`); on GPUs with programmatic
  dependent launch the decode and merge kernels are scheduled while the kernel before them drains.

Count per cached token and KV head (D = 128, topk = 16, bfloat16, G = 4, b = :func:`.cache.index_bits` (D) = 7):

- bytes from memory: topk * b / 8 = 14 of packed indices, topk * 2 = 32 of values, D * 2 = 256 of V: 302, against
  2 * D * 2 = 512 for dense K and V (1.70x fewer). Per decode step over 128K tokens and 8 KV heads: 316.7 MB (dense
  536.9 MB) -> 83 us at 3.8 TB/s, plus the float32 partials the merge reads back (2.1 MB at 8 programs per SM).
- work: 4 index words and 4 value words loaded, topk index extractions, topk vector loads of the table and G *
  topk = 64 float32 FMAs for the scores, G exponentials, and P @ V: G * D = 512 useful MACs, one [D, BLOCK_N] x
  [BLOCK_N, 8] MMA per tile (the 4 rows padded to the MMA's 8: 16 HMMAs per 32-key tile). The sm_90 SASS of the
  main loop (triton 3.6, 32-key tiles, one warp, V through TMA, 5 stages) is 633 instructions per tile, 20 per
  token and KV head (v8: 767; byte-wide index loads, shuffled denominators and exponentials with a subnormal
  fix-up; NOTES.md, v9).

MEASURED (H200, 128K cached tokens, GQA 32/8, CUDA-graph replays, gated; benchmarks/results/sfa_h200/NOTES.md, v11,
the merge in one step, the L2 prefetch): ``sieve bench sfa`` topk = 16 0.0926 ms, 1.47x dense SDPA-cuDNN decode
(0.136 ms), topk = 8 0.0907 ms, 1.50x (merge alone 1.46x / 1.59x; v10: 1.45x and 1.56x; v9 with fixed chunks: 1.30x
and 1.39x). The target, 1.5x at topk = 16, needs 0.0907 ms against that run's dense. In place (profiler, v10 call A,
fixed chunks) the kernel works 86 us (3.67 TB/s; cuDNN's decode kernel 129 us, 4.16 TB/s), the query table and the
merge add about 3 and 4 us, and the per-program timers show SMs finishing the same work 15 us apart, which the pool
narrows. Session 36 (H100, benchmarks/results/session36): pool units that shrink to single tiles took the step at
128K from 0.1217-0.1224 to 0.1202-0.1208 ms at topk = 16 and from 0.1133-0.1140 to 0.1109-0.1123 at topk = 8 (dense
0.188); gated bench 1.56x and 1.68x. On the H200 (session 42, benchmarks/results/session42) the gated bench
read 0.0920 ms at topk = 16, 1.46x dense's 0.1346, and 0.0837 ms, 1.61x, at topk = 8. Session 47 (H200, gated
probe): with a 5% pool at topk = 16 (:func:`_pool_fraction`) 0.0910 ms against 0.1360, 1.495x (10%: 0.0918).
Session 49 (H200, benchmarks/results/session49, the one-pass merge): gated bench in five runs, topk = 16
0.0899-0.0907 ms against 0.1349-0.1360, 1.487-1.507x (median 1.501x), topk = 8 1.613-1.625x; probe 0.0908 ms
against 0.1358, 1.496x (session 47's merge 0.0908 beside it).
"""
from __future__ import annotations

from functools import partial

import torch

from ..._checks import FLOAT_DTYPES, check_choice, check_no_nan, fail, resolve_scale
from ...config import SFA_DECODE_BACKENDS
from .. import split_k
from ..split_k import program_rows, store_rows
from ..triton_common import (LOG2E, allow_next_kernel, choose_backend, hopper_or_newer, is_interpreted, jit,
                             kernel_blocker, on_device_of, prefetch_l2, prefetch_rows_l2, softmax_finish, softmax_start,
                             softmax_step, triton, wait_for_prior_kernel)
from .cache import SFAKeyCache
from .codes import scatter_codes, sparsify
from .pool import pool_unit, unit_levels

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor


# Measured on an H200 at 128K cached tokens, GQA 32/8, D = 128 (CUDA-graph replays; benchmarks/results/sfa_h200,
# v6): one warp per program and 32-key tiles beat 2-8 warps and 16- to 256-key tiles. Stages (v9): Triton 3.6
# keeps one buffer of each staged load (the V tile's too) at 3-4 stages, two at 5-6 (28 KB of shared memory at
# D = 128, so 8 programs per SM fit), three at 8 (42 KB, 5 per SM). Swept with the programs per SM (call C, gated):
# 5 stages at 8 per SM fastest at topk = 16 (0.098 ms; 4 stages 0.103-0.114; 8 stages 0.104-0.121), topk = 8
# within noise of the best (0.094 vs 0.091). Session 50 (H100, 128K, 5 interleaved rounds): 4 stages, where 8
# programs fit again (15.5 / 16.9 KiB against 30.7 / 33.6), still slower at topk = 20 and 24 than 5 stages at the 7
# and 6 an SM holds: 0.1264 vs 0.1244 ms, 0.1314 vs 0.1299.
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 32, 1, 5
# Programs per SM (:func:`_programs_per_sm`). v9 call C (128K, GQA 32/8, 5 stages, gated; k = 8 and 16 summed):
# at D = 128, 8 (0.094 + 0.098 ms; 5-7 per SM 0.093-0.094 + 0.100-0.105); at D = 64, 10 (0.064 + 0.073; 8 and 12
# per SM 0.061 + 0.084, 0.062 + 0.085). Run-to-run spread of one plan in one session is up to 9% (the same 5-stage
# plan re-timed: 0.102 + 0.107 at D = 128). Head dims 16, 32 and 256 are not measured. What an SM holds of the
# compiled kernel (sm_90, 5 stages, Triton 3.6 and 3.9; session 50): at D = 128 9 / 8 / 7 / 6 programs at topk =
# 8 / 16 / 20 / 24, at D = 64 15 / 11 / 9 / 8; so v9's 12 per SM at D = 64 ran 11 at topk = 16 (its 0.085 ms came
# from the programs past them), and more than 8 at D = 128 was never measured. Probed in session 50 (H100, 128K, 5
# interleaved rounds, beside the committed plans): 12 wanted at D = 64 (topk = 8 gets 12, topk = 16 11) 0.0703 /
# 0.0791 against 0.0709 / 0.0797 ms, 0.8% faster; 9 at D = 128 (topk = 8 gets 9) 0.1117 against 0.1120, while its
# control, topk = 16 at 8 either way, moved 0.2%. Session 51 (another H100, 5-9 interleaved rounds;
# benchmarks/results/session51/) at D = 64, 11 and 12 wanted against 10: topk = 16 (11 held) 1-3% faster at 32K
# and 128K, batch 1 and 4; topk = 8 2.5% slower at 32K with either, at 128K 0.4% faster with 11 and 0.4-0.8% slower
# with 12 (where session 50's H100 found 12 0.8% faster), 2.5% faster with 12 at batch 4; within 1% at 8K. Mixed,
# so 10 stays.
_PROGRAMS_PER_SM_WIDE, _PROGRAMS_PER_SM_NARROW = 8, 10
# The pool of keys the programs take over from each other (:func:`_sfa_decode_chunk`): the fraction of the tiles
# left out of the chunks, and the tiles of one unit taken at a time. v10 call D (128K, GQA 32/8, 5 stages, gated,
# hot, 5 interleaved rounds): at D = 128 a 10% pool of 4-tile units took topk = 16 from 0.0988 to 0.0968 ms and
# topk = 8 from 0.0940 to 0.0897 (15-30% pools: 0.0984-0.0989 and 0.0894-0.0901; 8-tile units slower, 2-tile
# units about equal); at D = 64 (10 per SM) topk = 8 0.0650 -> 0.0602, topk = 16 0.0730 -> 0.0732 (20-30%:
# 0.0755-0.0765, slower). Session 36 (H100, gated, 7 interleaved rounds): units that shrink as the pool drains
# (:mod:`.pool`: 4 tiles, then 2, then 1) took topk = 16 from 0.1218 to 0.1202 ms and topk = 8 from 0.1133
# to 0.1111 (dense 0.1880); a 5% pool 0.1200 / 0.1147, 15% 0.1201 / 0.1109, 20% 0.1211 / 0.1108; from 8-tile units
# 0.1228 / 0.1123, from 2-tile units 0.1210 / 0.1110.
# The chunks are rounded down to whole tiles, so the pool is larger than _POOLED: 13% at 128K and D = 128 (27 of
# the fixed plan's 32 tiles per chunk kept), 23% at 32K, 48% at 8K. Short chunks keep no pool: each unit restarts
# the software pipeline. The test is on the fixed plan's chunk length, which batch and heads shorten as well as the
# cache. With 4-tile units the pool paid only from 32-tile chunks (v10 call E, D = 128, topk = 8 / 16: 8K 0.96x /
# 0.89x dense against 1.08x / 1.06x with fixed chunks, 32K 1.28x / 1.18x against 1.30x / 1.22x). With shrinking
# units (session 36, measured on an H100 only, gated, 7 interleaved rounds, fixed chunks against the pool; dense
# 62.6 / 104.8 us) it is faster or even from 8-tile chunks on: 32K (8 tiles) topk = 8 43.5 -> 42.3 us, topk = 16
# 45.9 -> 46.0; 64K (16) 69.2 -> 65.8 and 72.8 -> 70.6; below, slower: 16K (4 tiles) 27.5 -> 27.8 and 29.1 ->
# 30.8, 8K (2) 19.6 -> 20.8 and 20.3 -> 23.8 (benchmarks/results/session36).
# Session 47 (H200, 128K, D = 128, gated, 5 interleaved rounds, three calls): a smaller pool suits topk = 16,
# not topk = 8: _POOLED 0.05 (29 tiles per chunk kept, a 6.5% pool) topk = 16 0.0909-0.0910 ms against 0.0918-0.0919
# at 0.1, 0.03 0.0916, 0.07 0.0914, 0 (no pool) 0.0945; topk = 8 0.0865 against 0.0839 at 0.1, 0.07 0.0839
# (benchmarks/results/session47). Session 36's H100 leaned the same way (above). So topk >= 16 pools _POOLED_TOPK16.
_POOLED, _POOLED_TOPK16, _UNIT_TILES, _POOL_FROM_TILES = 0.1, 0.05, 4, 8
# Tiles of its chunk each program has L2 prefetch while it waits for the query table (DRAM is idle then). v11
# call C (128K, D = 128, gated, 5 interleaved rounds): 0 / 1 / 2 / 4 / 8 tiles, topk = 16 0.0940 / 0.0925 / 0.0924
# / 0.0934 / 0.0970 ms, topk = 8 0.0869 / 0.0851 / 0.0851 / 0.0853 / 0.0899; 64K topk = 16 0.0595 / 0.0580 /
# 0.0577 / 0.0583 / 0.0630 (more than the wait covers competes with the chunk's own loads).
# A power of two (the tiles' keys are one arange). v12 (session 28): prefetching inside the key loop as well, a
# fixed number of tiles ahead, or each pool unit's keys as it is taken, made the step slower (NOTES.md, v12).
_PREFETCH_TILES = 2
# Shared memory a pipelined launch may ask for (an H200 block gets 227 KiB; the dots' conversions need some).
_SHARED_BUDGET = 160 * 1024
# Elements of one densified key block (and of one score block) in the reference: 16 MiB in float32.
_BLOCK_ELEMENTS = 2 ** 22
# Coordinates compared per step when ranking a query's coordinates: a [D, 32] compare is 32 int32 per thread at
# D = 128 with 4 warps.
_SPARSIFY_BLOCK_V = 32


@jit
def _raw_index_word(key_words, key_shift, key_ok, A: tl.constexpr, NBYTES: tl.constexpr):
    """Raw 4-byte word A from the word holding each key's first packed byte, uint32 [BLOCK_N], where it holds any of
    the key's NBYTES bytes (key_shift / 8 is the first byte's offset in word 0), else 0 (unread: it may lie past the
    cache's allocation); missing keys read 0. One mask expression for every use of a word, so that loads of the same
    word are one (the compiler merges identical loads)."""
    return tl.load(key_words + A, mask=key_ok & (4 * A < key_shift // 8 + NBYTES), other=0)


@jit
def _index_word(key_words, key_shift, key_ok, A: tl.constexpr, NBYTES: tl.constexpr):
    """Bits [32 A, 32 A + 32) of each key's packed indices, uint32 [BLOCK_N] (bits past the key's last byte are
    whatever follows it, or 0). key_words [BLOCK_N] (uint32 pointers) is the 4-byte word holding each key's first
    byte, key_shift [BLOCK_N] (uint32) that byte's bit offset in it (0, 8, 16 or 24): word A of the key is raw words
    A and A + 1 (:func:`_raw_index_word`) funnel-shifted by key_shift."""
    bits = _raw_index_word(key_words, key_shift, key_ok, A, NBYTES) >> key_shift
    # The most raw words a key's bytes can touch, at the largest first-byte offset NBYTES allows (an even NBYTES
    # starts at offset 0 or 2 only).
    OFFSET: tl.constexpr = 0 if NBYTES % 4 == 0 else (2 if NBYTES % 2 == 0 else 3)
    if A + 1 < (OFFSET + NBYTES + 3) // 4:
        above = _raw_index_word(key_words, key_shift, key_ok, A + 1, NBYTES)
        # Two shifts, never one of 32 bits (undefined): at key_shift 0 the word above contributes nothing.
        bits = bits | ((above << 8) << (24 - key_shift))
    return bits


@jit
def _packed_index(key_words, key_shift, key_ok, T: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr):
    """Index T of each key of a tile, int32 [BLOCK_N]: bits [T * BITS, (T + 1) * BITS) of the key's NBYTES packed
    bytes read as one little-endian integer (:func:`.cache.pack_indices`), taken from its 4-byte words
    (:func:`_index_word`); missing keys read 0.

    Why words: 4-byte loads are staged by the software pipeline (cp.async) with the V tile, whereas byte loads stay
    in the loop, and the table gathers that need the indices waited a memory latency on them every tile (v8:
    14 byte loads per key). A word that serves several T is one load: same address and mask, merged by the
    compiler, as is the funnel shift that several T share."""
    tl.static_assert(BITS <= 32, "a packed index must fit in one 32-bit word")
    FIRST: tl.constexpr = T * BITS
    A: tl.constexpr = FIRST // 32
    OFF: tl.constexpr = FIRST % 32
    bits = _index_word(key_words, key_shift, key_ok, A, NBYTES) >> OFF
    if OFF + BITS > 32:
        bits = bits | (_index_word(key_words, key_shift, key_ok, A + 1, NBYTES) << (32 - OFF))
    return (bits & ((1 << BITS) - 1)).to(tl.int32)


@jit
def _sparse_query_table(X, TABLE, COUNTERS, stride_xb, stride_xh, stride_xt, stride_xd, heads, kv_heads, q_len, topk,
                        row_blocks, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (B * Hq * Tq,). Writes ``sparsify(X, topk)`` for X [B, Hq, Tq, D] (any strides, no NaN), one query row
    per program, into TABLE [B, Hkv, row_blocks, D, BLOCK_M] (contiguous, X's dtype): row r = (h % G) * Tq + i of KV
    head h // G (G = Hq / Hkv) goes to column r % BLOCK_M of row block r // BLOCK_M, so the BLOCK_M rows of one
    decode program lie side by side under each coordinate. Columns of no row (the last block's padding) are left
    as they are. Sets COUNTERS [B * Hkv * row_blocks] (int32; the decode kernel's pool counters, one per row
    block) to 0: the program of each block's first row does.

    Coordinate u keeps x_u iff fewer than topk coordinates v rank above it, v ranking above u when |x_v| > |x_u|,
    or |x_v| == |x_u| and v < u (the rule of :mod:`.codes`, ties to the lower index, so the same coordinates as its
    stable sort); the others become 0. The ranks are counted BLOCK_V coordinates v at a time ([D, BLOCK_V] compares
    per step). One launch in place of the sort, gather, fill and scatter of :func:`.codes.sparsify` (a decode step's
    fixed cost)."""
    allow_next_kernel()  # the decode kernel may be scheduled at once; it waits for this one before reading
    row = tl.program_id(0).to(tl.int64)
    b, h, i = row // (heads * q_len), row // q_len % heads, row % q_len
    x_row = X + b * stride_xb + h * stride_xh + i * stride_xt
    u = tl.arange(0, HEAD_DIM)
    x = tl.load(x_row + u * stride_xd)
    size_u = tl.abs(x.to(tl.float32))[:, None]  # exact for every input dtype
    rank = tl.zeros([HEAD_DIM], tl.int32)
    for v0 in range(0, HEAD_DIM, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        size_v = tl.abs(tl.load(x_row + v * stride_xd).to(tl.float32))[None, :]
        above = (size_v > size_u) | ((size_v == size_u) & (v[None, :] < u[:, None]))
        rank += tl.sum(above.to(tl.int32), axis=1)
    group = heads // kv_heads
    r = h % group * q_len + i
    block = (b * kv_heads + h // group) * row_blocks + r // BLOCK_M
    tl.store(TABLE + (block * HEAD_DIM + u) * BLOCK_M + r % BLOCK_M, tl.where(rank < topk, x, tl.zeros_like(x)))
    if r % BLOCK_M == 0:
        tl.store(COUNTERS + block, 0)


@jit
def _code_value(key_words, key_ok, T: tl.constexpr, PER_WORD: tl.constexpr, VALUE_DTYPE: tl.constexpr):
    """Value T of each key of a tile, float32 [BLOCK_N]; key_words [BLOCK_N] points at each key's values, read as
    words of PER_WORD values each (value T is bits [T % PER_WORD * b, ...) of word T // PER_WORD, b the bits of
    VALUE_DTYPE, little-endian; PER_WORD = 1: the values themselves). Missing keys read 0.

    Why words: a value load of 2 bytes per thread cannot be staged by cp.async (4 bytes at least), so the pipeline
    left it in the loop, waiting a memory latency each tile; 4- or 8-byte words are staged with the V tile. A word
    that serves several T is one load: same address and mask, merged by the compiler."""
    word = tl.load(key_words + T // PER_WORD, mask=key_ok, other=0)
    if PER_WORD == 1:
        value = word
    else:
        BITS: tl.constexpr = VALUE_DTYPE.primitive_bitwidth
        bits = (word >> (T % PER_WORD * BITS)) & ((1 << BITS) - 1)
        value = bits.to(tl.int16 if BITS == 16 else tl.int32).to(VALUE_DTYPE, bitcast=True)
    return value.to(tl.float32)


@jit
def _code_scores(table, index_words, index_shift, value_words, key_ok, TOPK: tl.constexpr, INDEX_BITS: tl.constexpr,
                 NBYTES: tl.constexpr, PER_WORD: tl.constexpr, VALUE_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Unscaled scores [BLOCK_N, BLOCK_M] float32 of a tile of cached keys against the program's query rows, read
    from the codes: s[j, m] = sum over t < TOPK of q~[m, idx[j, t]] * val[j, t], the dot of the zero-filled sparse
    query with the densified key, which is never built.

    table: the program's block of the query table, [D, BLOCK_M] contiguous (:func:`_sparse_query_table`);
    index_words, index_shift [BLOCK_N]: where each key's NBYTES packed index bytes start (:func:`_index_word`);
    value_words [BLOCK_N]: its values as words (:func:`_code_value`); key_ok [BLOCK_N]: which keys exist (the
    others read index 0 and value 0, so they score 0).

    Keys along the first axis, rows along the second: one thread holds one key with all its rows, so each (key,
    code) is unpacked and loaded once and serves BLOCK_M rows, and the rows' q entries under the code's index are
    BLOCK_M neighbours in the table: one vector load (8 bytes at 4 bfloat16 rows), from a table of D * BLOCK_M
    elements (1 KiB) that stays in L1. The table's padding columns are 0 (their scores are masked anyway)."""
    m = tl.arange(0, BLOCK_M)
    s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for t in tl.static_range(TOPK):
        coord = _packed_index(index_words, index_shift, key_ok, t, INDEX_BITS, NBYTES)  # missing key: 0, in bounds
        value = _code_value(value_words, key_ok, t, PER_WORD, VALUE_DTYPE)
        q_at = tl.load(table + coord[:, None] * BLOCK_M + m[None, :])
        # Products of 16-bit values are exact in float32, as in a tensor-core dot.
        s += q_at.to(tl.float32) * value[:, None]
    return s


@jit
def _key_range(acc_t, l_t, m_i, start, stop, table, idx_head, val_head, V_DESC, v_head, b, kv_head, row_ok, q_pos, d,
               scale, stride_kt, stride_vt, stride_vd, HEAD_DIM: tl.constexpr, TOPK: tl.constexpr,
               INDEX_BITS: tl.constexpr, NBYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               PER_WORD: tl.constexpr, VALUE_DTYPE: tl.constexpr, NATIVE_DOT: tl.constexpr, V_TMA: tl.constexpr):
    """The online softmax state (:func:`..triton_common.softmax_step`) carried over cached keys [start, stop) of one
    KV head, BLOCK_N at a time (start a multiple of BLOCK_N), against the program's rows; arguments as in
    :func:`_sfa_decode_chunk` (the head's pointers already offset)."""
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        key_ok = n < stop
        first_byte = n * NBYTES
        s = _code_scores(table, idx_head + first_byte // 4, (first_byte % 4 * 8).to(tl.uint32),
                         val_head + n * stride_kt, key_ok, TOPK, INDEX_BITS, NBYTES, PER_WORD, VALUE_DTYPE, BLOCK_M,
                         BLOCK_N)
        s = tl.where(key_ok[:, None] & row_ok[None, :] & (n[:, None] <= q_pos[None, :]), scale * s, float("-inf"))
        if V_TMA:
            v_t = tl.trans(V_DESC.load([b.to(tl.int32), kv_head.to(tl.int32), n0, 0]).reshape(BLOCK_N, HEAD_DIM))
        else:
            v_t = tl.load(v_head + n[None, :] * stride_vt + d[:, None] * stride_vd, mask=key_ok[None, :], other=0.0)
        acc_t, l_t, m_i = softmax_step(acc_t, l_t, m_i, s, v_t, NATIVE_DOT)
    return acc_t, l_t, m_i


@jit
def _sfa_decode_chunk(
    Q, TABLE, COUNTERS, IDX, VAL, V, V_DESC, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_ib, stride_ih,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_vd,
    kv_heads, group, q_len, k_len, scale, chunk_keys, num_chunks,
    HEAD_DIM: tl.constexpr, TOPK: tl.constexpr, INDEX_BITS: tl.constexpr, NBYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_WORD: tl.constexpr, VALUE_DTYPE: tl.constexpr,
    NATIVE_DOT: tl.constexpr, V_TMA: tl.constexpr, UNIT_LEVELS: tl.constexpr, PREFETCH_TILES: tl.constexpr,
):
    """Grid (B * Hkv, chunks, row blocks). Q: the queries [B, Hq, Tq, D] (only their layout is read: the rows and
    positions); TABLE: their sparse query table [B, Hkv, row blocks, D, BLOCK_M] (:func:`_sparse_query_table`);
    IDX: the cached keys' packed indices uint8 [B, Hkv, Tk, NBYTES = ceil(TOPK * INDEX_BITS / 8)]
    (:func:`.cache.pack_indices`); VAL: their values [B, Hkv, Tk, TOPK] (VALUE_DTYPE) viewed as words of PER_WORD
    values [B, Hkv, Tk, TOPK / PER_WORD] (:func:`_code_value`); V [B, Hkv, Tk, D], read through V_DESC, its TMA
    descriptor in [1, 1, BLOCK_N, D] tiles (:func:`_v_tile_descriptor`), when V_TMA, else through its pointer and
    strides. BLOCK_M rows per program, any power of two (the rows are the N of the MMAs, which pad them to 8
    themselves: :func:`..triton_common.softmax_step`). ``scale``: the logit scale times log2 e (the softmax is in
    base 2).

    Which keys a program takes: its chunk's own, keys [c * chunk_keys, (c + 1) * chunk_keys) of chunk c, then
    units of the pool past every chunk's own, [chunks * chunk_keys, Tk), one at a time, each to the program of its
    (batch, KV head, row block) that asks first: COUNTERS (int32, one per row block, [B * Hkv * row blocks], 0 when
    the kernel starts: :func:`_sparse_query_table` sets them) counts the requests, so a request's count is the
    number of its unit (:func:`.pool.pool_unit`: units of 2 ** (UNIT_LEVELS - 1) tiles at most, shrinking to single
    tiles as the pool drains), and each program's last request is refused: a counter ends at units + chunks. Why:
    the programs of a step all run at once (one wave), and programs on some SMs run faster than on others (v10: on
    SMs holding 7 programs, the same work ended anywhere from 77 to 92 us), so with fixed chunks the kernel waits
    for the slowest SM; the pool lets the fast ones take over the rest, and the units handed out last, which set
    when the programs that still take units end, are single tiles.

    Writes each row's output over the keys the program took (normalised over them) and its log-sum-exp to O [B, Hq,
    Tq, chunks, D] and LSE [B, Hq, Tq, chunks] (float32, contiguous). The split depends on the timing, the result
    does not beyond float32 rounding: the merge (:func:`..split_k.merge`) is exact for any partition."""
    # The scores read q through the table: program_rows' dense q tile goes unused, and the compiler drops its load.
    b, kv_head, r, row_ok, q_pos, d, _, _, start, stop = program_rows(
        Q, stride_qb, stride_qh, stride_qt, stride_qd, kv_heads, group, q_len, k_len, chunk_keys, BLOCK_M, HEAD_DIM)
    table = TABLE + ((b * kv_heads + kv_head) * tl.num_programs(2) + tl.program_id(2)) * (HEAD_DIM * BLOCK_M)
    # Each head's packed indices are NBYTES per key, back to back, from a 4-byte boundary (:func:`_index_layout`).
    idx_head = (IDX + b * stride_ib + kv_head * stride_ih).to(tl.pointer_type(tl.uint32), bitcast=True)
    val_head = VAL + b * stride_kb + kv_head * stride_kh
    v_head = V + b * stride_vb + kv_head * stride_vh
    if PREFETCH_TILES > 0:
        # DRAM is idle while the query table is built: have L2 fetch this program's first tiles meanwhile.
        n = tl.minimum(start + tl.arange(0, PREFETCH_TILES * BLOCK_N), k_len - 1)
        prefetch_rows_l2(v_head, n, stride_vt, stride_vd, HEAD_DIM)
        prefetch_l2(val_head + n * stride_kt)
        prefetch_l2(idx_head + n * NBYTES // 4)
    wait_for_prior_kernel()  # the query table (a programmatic dependent launch where the GPU can)

    acc_t, l_t, m_i = softmax_start(BLOCK_M, HEAD_DIM, BLOCK_N)
    acc_t, l_t, m_i = _key_range(acc_t, l_t, m_i, start, stop, table, idx_head, val_head, V_DESC, v_head, b, kv_head,
                                 row_ok, q_pos, d, scale, stride_kt, stride_vt, stride_vd, HEAD_DIM, TOPK, INDEX_BITS,
                                 NBYTES, BLOCK_M, BLOCK_N, PER_WORD, VALUE_DTYPE, NATIVE_DOT, V_TMA)
    # Then units of the keys past every chunk's own (:func:`.pool.pool_unit`), taken in turn by whichever program of
    # this row block asks first (the table kernel set the block's counter to 0): programs on SMs that run fast take
    # more.
    counter = COUNTERS + tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
    pool_start = num_chunks * chunk_keys
    unit, unit_stop = pool_unit(tl.atomic_add(counter, 1, sem="relaxed"), pool_start, k_len, BLOCK_N, UNIT_LEVELS)
    while unit < k_len:
        acc_t, l_t, m_i = _key_range(acc_t, l_t, m_i, unit, unit_stop, table, idx_head, val_head, V_DESC, v_head, b,
                                     kv_head, row_ok, q_pos, d, scale, stride_kt, stride_vt, stride_vd, HEAD_DIM,
                                     TOPK, INDEX_BITS, NBYTES, BLOCK_M, BLOCK_N, PER_WORD, VALUE_DTYPE, NATIVE_DOT,
                                     V_TMA)
        unit, unit_stop = pool_unit(tl.atomic_add(counter, 1, sem="relaxed"), pool_start, k_len, BLOCK_N,
                                    UNIT_LEVELS)

    allow_next_kernel()  # the merge
    # A row may have no key among those this program took (a query before them): output 0 and log-sum-exp -inf.
    out, lse = softmax_finish(acc_t, l_t, m_i)
    store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM)


_INTERPRETED = triton is not None and is_interpreted(_sfa_decode_chunk)


def sfa_decode(q: torch.Tensor, cache: SFAKeyCache, *, scale: float | None = None,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """SFA attention of the newest Tq tokens' queries against every cached token (a decode step).

    Args:
        q: [B, Hq, Tq, D] after RoPE, in the cache's dtype and device, Hq a multiple of the cache's Hkv (query head h
            reads KV head h // (Hq // Hkv)), 1 <= Tq <= len(cache). Append the new tokens' keys and values to the
            cache first: query i sits at cache position len(cache) - Tq + i and attends positions <= its own.
        cache: the layer's :class:`.cache.SFAKeyCache`; q is sparsified with its ``topk``.
        scale: logit scale, default 1/sqrt(D) (the full head dim, not 1/sqrt(topk)).
        backend: "reference" (PyTorch, differentiable), "triton" (CUDA, or the interpreter with
            TRITON_INTERPRET=1; float16, bfloat16 or float32, D a power of two in [16, 256]; no backward, so
            refused where autograd records q) or "auto" (triton on CUDA when it can, else the reference).

    Returns out [B, Hq, Tq, D] (q's dtype) and lse [B, Hq, Tq] (float32, natural log), equal to
    ``sfa_attention_reference(q, K, V, topk=cache.topk, causal=True, scale=scale)`` with K the dense keys the cache
    was built from and V its values. The triton backend on long caches lets its programs share out part of the
    keys at run time (:func:`_sfa_decode_chunk`), so two calls may differ by float32 rounding (an ulp of a 16-bit
    output at most), CUDA-graph replays too; the reference backend is deterministic.
    """
    _check_decode_call(q, cache)
    scale = resolve_scale(scale, q.shape[-1])
    if _resolve_backend(q, backend) == "reference":
        out, lse = sfa_decode_reference(q, cache, scale=scale)
        return out, lse.float()
    return sfa_decode_triton(q, cache, scale=scale)


def _check_decode_call(q, cache) -> None:
    """q must fit the cache: layout, dtype, device, batch, head dim, a head count the cache's divides, Tq in
    [1, len(cache)], no NaN."""
    if not isinstance(cache, SFAKeyCache):
        fail("cache", "an SFAKeyCache", type(cache).__name__)
    if not isinstance(q, torch.Tensor):
        fail("q", "a torch.Tensor [B, Hq, Tq, D]", type(q).__name__)
    if q.dim() != 4:
        fail("q", "a 4-d tensor [B, Hq, Tq, D]", f"shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        fail("q", "a float16, bfloat16, float32 or float64 tensor", q.dtype)
    batch, q_heads, q_len, head_dim = q.shape
    if cache.dtype != q.dtype:
        fail("cache", f"a cache of q's dtype {q.dtype}", cache.dtype)
    if cache.device != q.device:
        fail("cache", f"a cache on q's device {q.device}", cache.device)
    if cache.batch != batch:
        fail("cache", f"a cache of q's batch size {batch}", cache.batch)
    if cache.head_dim != head_dim:
        fail("cache", f"a cache of q's head dim {head_dim}", cache.head_dim)
    if q_heads % cache.kv_heads != 0:
        fail("q", f"a number of query heads divisible by the cache's {cache.kv_heads} KV heads", q_heads)
    if q_len == 0:
        fail("q", "at least one query token", 0)
    if q_len > cache.length:
        fail("cache", f"at least {q_len} cached tokens (q's Tq; append the new tokens before decoding)",
             cache.length)
    check_no_nan(q=q)


def _resolve_backend(q: torch.Tensor, backend: str) -> str:
    check_choice("backend", backend, SFA_DECODE_BACKENDS)
    # The kernel has no backward: where autograd records, auto takes the reference, and triton is refused rather
    # than returning an output cut off from q's graph.
    recording = torch.is_grad_enabled() and q.requires_grad
    blocker = "the triton decode kernel has no backward, and q requires grad" if recording else kernel_blocker(q)
    return choose_backend(backend, q, blocker)


def sfa_decode_reference(q: torch.Tensor, cache: SFAKeyCache, *, scale: float,
                         block_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch :func:`sfa_decode` (arguments already checked), in float32 or wider.

    The cached keys are unpacked and densified ``block_keys`` at a time (default: about 2**22 elements per block),
    so memory is O(block) beyond the cache, never a dense K of the whole cache; an online softmax carries the
    blocks.

    Returns out [B, Hq, Tq, D] (q's dtype) and lse [B, Hq, Tq] (float32, or float64 for float64 q).
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = cache.kv_heads, cache.length
    group = q_heads // kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    if block_keys is None:
        block_keys = max(16, _BLOCK_ELEMENTS // (batch * kv_heads * max(head_dim, group * q_len)))
    qg = sparsify(q, cache.topk).to(compute_dtype).reshape(batch, kv_heads, group, q_len, head_dim)
    v = cache.values()
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)

    m = torch.full((batch, kv_heads, group, q_len), float("-inf"), dtype=compute_dtype, device=q.device)
    total = torch.zeros_like(m)
    acc = torch.zeros(batch, kv_heads, group, q_len, head_dim, dtype=compute_dtype, device=q.device)
    for start in range(0, k_len, block_keys):
        stop = min(start + block_keys, k_len)
        keys = scatter_codes(*cache.keys(start, stop), head_dim).to(compute_dtype)  # unpacks this block only
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys) * scale
        k_pos = torch.arange(start, stop, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        # The first block holds key 0, which every query attends, so m_new is finite from the first block on.
        m_new = torch.maximum(m, scores.amax(dim=-1))
        probs = torch.exp(scores - m_new[..., None])
        alpha = torch.exp(m - m_new)
        total = total * alpha + probs.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("bhgqk,bhkd->bhgqd", probs, v[:, :, start:stop].to(compute_dtype))
        m = m_new
    out = (acc / total[..., None]).to(q.dtype).reshape(batch, q_heads, q_len, head_dim)
    return out, (m + torch.log(total)).reshape(batch, q_heads, q_len)


def sfa_decode_triton(q: torch.Tensor, cache: SFAKeyCache, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`sfa_decode` (arguments already checked, ``kernel_blocker(q)`` None).

    Returns out [B, Hq, Tq, D] (q's dtype) and lse [B, Hq, Tq] (float32). Scores, softmax and accumulation are
    float32; the probabilities enter P @ V rounded to V's dtype, as in FlashAttention
    (:func:`..triton_common.softmax_step`)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = cache.kv_heads, cache.length
    plan = partial(decode_plan, batch, q_heads, kv_heads, q_len, k_len, head_dim, cache.topk, q.device)
    work = plan()
    packed, values = cache.packed_keys()
    _index_layout(packed)
    words = _value_words(values)
    v = cache.values()
    v_tiles = _v_tile_descriptor(v)
    options = dict(
        HEAD_DIM=head_dim, TOPK=cache.topk, INDEX_BITS=cache.index_bits, NBYTES=cache.packed_bytes,
        BLOCK_M=work.block_m, BLOCK_N=_BLOCK_N, PER_WORD=words.element_size() // values.element_size(),
        VALUE_DTYPE=getattr(tl, str(values.dtype).removeprefix("torch.")),
        NATIVE_DOT=q.dtype != torch.float32 and not _INTERPRETED, V_TMA=v_tiles is not None,
        UNIT_LEVELS=unit_levels(_UNIT_TILES), PREFETCH_TILES=_PREFETCH_TILES,
        num_warps=_NUM_WARPS, launch_pdl=hopper_or_newer(q.device),
        num_stages=_pipeline_stages(cache.topk, work.block_m, head_dim, q.element_size()))

    def arguments(table, counters, part_out, part_lse, work):
        return (q, table, counters, packed, words, v, v_tiles, part_out, part_lse,
                *q.stride(), *packed.stride()[:2], *words.stride()[:3], *v.stride(),
                kv_heads, q_heads // kv_heads, q_len, k_len, scale * LOG2E, work.chunk_keys, work.chunks)

    # The merge rounds to q's dtype itself on GPUs; the interpreter truncates float32 -> 16-bit casts, so there it
    # merges in float32 and torch rounds.
    out = torch.empty(q.shape, dtype=torch.float32 if _INTERPRETED else q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with on_device_of(q):
        wanted = _programs_per_sm(head_dim)
        signature = arguments(q.dtype, torch.int32, torch.float32, torch.float32, work)
        held = split_k.programs_per_sm(_sfa_decode_chunk, signature, options, q.device, wanted)
        if held < wanted:
            work = plan(programs_per_sm=held)
        part_out, part_lse = split_k.partials(q, work.chunks)
        table, counters = sparse_query_table(q, cache.topk, kv_heads, work.block_m)
        _sfa_decode_chunk[(batch * kv_heads, work.chunks, work.row_blocks)](
            *arguments(table, counters, part_out, part_lse, work), **options)
        split_k.merge(part_out, part_lse, out, lse)
    return out.to(q.dtype), lse


def _index_layout(packed: torch.Tensor) -> None:
    """The layout the kernel reads packed indices [B, Hkv, T, bytes] in, which :class:`.cache.SFAKeyCache` keeps:
    each head's keys back to back (strides bytes and 1), the head's first byte on a 4-byte boundary (base, batch
    and head strides multiples of 4), and the head's allocation ending on one, so that the 4-byte words the kernel
    reads (:func:`_index_word`) lie in it. The stride of a batch or head dimension of size 1 is never stepped
    (``view`` gives one the size of what follows: a single KV head of an odd byte count)."""
    aligned = packed.data_ptr() % 4 == 0 and all(stride % 4 == 0 for size, stride in
                                                 zip(packed.shape[:2], packed.stride()[:2]) if size > 1)
    if packed.stride()[2:] != (packed.shape[-1], 1) or not aligned:
        fail("cache", "packed indices in the SFAKeyCache layout (keys back to back, heads on 4-byte boundaries)",
             f"strides {packed.stride()} at offset {packed.data_ptr() % 4} mod 4")


def _v_tile_descriptor(v: torch.Tensor):
    """A TMA descriptor of V [B, Hkv, T, D] in [1, 1, _BLOCK_N, D] tiles where the copy engine can serve it (a GPU of
    compute capability 9 or more, or the interpreter; the base and every stride but the unit last one multiples of
    16 bytes, as a cache's V is), else None (the kernel then loads V through pointers). Rows past T read 0.

    Why: the tile then costs one copy instruction rather than a masked 16-byte copy with its address per thread and
    row: with it the step at 128K, topk = 16 took 0.106 rather than 0.110 ms (v8)."""
    capable = _INTERPRETED or hopper_or_newer(v.device)
    aligned = v.data_ptr() % 16 == 0 and v.stride(-1) == 1 and all(
        stride * v.element_size() % 16 == 0 for stride in v.stride()[:-1])
    if not (capable and aligned):
        return None
    return TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, _BLOCK_N, v.shape[-1]])


def _value_words(values: torch.Tensor) -> torch.Tensor:
    """The cached key values [B, Hkv, T, topk] (contiguous along topk, as the cache stores them) viewed as the
    widest words, 8 or 4 bytes, that hold whole values and tile each key's row (topk * itemsize a multiple of the
    word, and the row's start aligned to it), else as they are: [B, Hkv, T, topk * itemsize / word] of int64 or
    int32 (a view, no copy)."""
    row_bytes = values.shape[-1] * values.element_size()
    for word in (torch.int64, torch.int32):
        size = word.itemsize
        aligned = all(stride * values.element_size() % size == 0 for stride in values.stride()[:-1])
        if size > values.element_size() and row_bytes % size == 0 and aligned and \
                values.storage_offset() * values.element_size() % size == 0:
            return values.view(word)
    return values


def decode_plan(batch: int, q_heads: int, kv_heads: int, q_len: int, k_len: int, head_dim: int, topk: int,
                device: torch.device, programs_per_sm: int | None = None) -> split_k.Plan:
    """How a decode step of Tq = ``q_len`` queries over ``k_len`` cached keys splits its keys among programs
    (:func:`..split_k.plan`, in _BLOCK_N-key tiles, ``programs_per_sm`` to an SM, by default
    :func:`_programs_per_sm`; the step gives fewer where an SM holds fewer of its compiled kernel): fixed chunks
    that cover every key where the fixed plan's chunks are shorter than _POOL_FROM_TILES tiles, else chunks that
    leave at least :func:`_pool_fraction` (``topk``) of the tiles to the pool (:func:`_sfa_decode_chunk`)."""
    plan = partial(split_k.plan, batch, q_heads, kv_heads, q_len, k_len, device, block_n=_BLOCK_N,
                   programs_per_sm=_programs_per_sm(head_dim) if programs_per_sm is None else programs_per_sm)
    work = plan()
    if work.chunk_keys < _POOL_FROM_TILES * _BLOCK_N:
        return work
    return plan(pooled=_pool_fraction(topk))


def _programs_per_sm(head_dim: int) -> int:
    """Programs per SM of a decode step (:func:`..split_k.plan`): _PROGRAMS_PER_SM_WIDE from D = 128 on, else
    _PROGRAMS_PER_SM_NARROW. The step plans for fewer where an SM holds fewer of its compiled kernel
    (:func:`..split_k.programs_per_sm`)."""
    return _PROGRAMS_PER_SM_WIDE if head_dim >= 128 else _PROGRAMS_PER_SM_NARROW


def _pool_fraction(topk: int) -> float:
    """At least this share of a long cache's tiles is the pool (:func:`..split_k.plan`'s ``pooled``) for codes of
    ``topk`` entries: _POOLED_TOPK16 from topk = 16 on, else _POOLED."""
    return _POOLED_TOPK16 if topk >= 16 else _POOLED


def _pipeline_stages(topk: int, block_m: int, head_dim: int, itemsize: int) -> int:
    """_NUM_STAGES, or 1 where the software pipeline's buffers would not fit in shared memory: Triton stages each
    code's query-table gather besides the V tile and the value words, (stages - 1) * (topk * block_m + D + topk) *
    _BLOCK_N elements (an upper bound: Triton 3.6 keeps fewer buffers than stages - 1, see _NUM_STAGES)."""
    staged = (_NUM_STAGES - 1) * (topk * block_m + head_dim + topk) * _BLOCK_N * itemsize
    return _NUM_STAGES if staged <= _SHARED_BUDGET else 1


def sparse_query_table(q: torch.Tensor, topk: int, kv_heads: int,
                       block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.codes.sparsify` (q, topk) of q [B, Hq, Tq, D] (D a power of two, no NaN), laid out for the decode
    kernel by one launch: returns a new tensor [B, Hkv, ceil(G * Tq / block_m), D, block_m] of q's dtype (G = Hq /
    Hkv) whose [b, h // G, r // block_m, :, r % block_m] is sparsify(q)[b, h, i] for r = (h % G) * Tq + i, element
    for element (the last block's columns past G * Tq are 0), and the decode kernel's pool counters, int32 [B * Hkv
    * row blocks], set to 0 by the same launch. Call within q's device.

    Why a launch of its own: the decode programs are already resident while it runs (programmatic dependent launch)
    and prefetch their first tiles. Each program building its rows' table itself (loading q after its wait, a
    bitwise search for the topk-th magnitude, the store and a barrier) made the step 3-4 us slower at 32K and 128K
    (session 44, H100, benchmarks/results/session44)."""
    batch, heads, q_len, head_dim = q.shape
    rows = heads // kv_heads * q_len
    row_blocks = triton.cdiv(rows, block_m)
    # Zeros only where a padding column exists (one more launch); the kernel writes every other element.
    allocate = torch.empty if rows % block_m == 0 else torch.zeros
    table = allocate(batch, kv_heads, row_blocks, head_dim, block_m, dtype=q.dtype, device=q.device)
    counters = torch.empty(batch * kv_heads * row_blocks, dtype=torch.int32, device=q.device)
    _sparse_query_table[(batch * heads * q_len,)](q, table, counters, *q.stride(), heads, kv_heads, q_len, topk,
                                                  row_blocks, HEAD_DIM=head_dim, BLOCK_M=block_m,
                                                  BLOCK_V=min(head_dim, _SPARSIFY_BLOCK_V))
    return table, counters
