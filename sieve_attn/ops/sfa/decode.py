"""SFA decode step: a few new queries against the compressed key cache (:class:`.cache.SFAKeyCache`).

The queries are sparsified per query head with the rule every SFA path shares (:mod:`.codes`); the score of a query
and a cached key is ``scale * sum over the coordinates both keep of q~_u * k~_u``, then causal softmax and P.V with
the dense cached V: exactly :func:`.reference.sfa_attention_reference` (q, K, V, causal=True) where K are the dense
keys the cache was built from. Two backends compute it:

- ``reference``: plain PyTorch. Unpacks and densifies the cached keys one block at a time (never the whole cache)
  and runs an online softmax over the blocks.
- ``triton``: flash-decoding split-K (:mod:`sieve_attn.ops.split_k`), bound by the bytes of the cache. One launch
  sparsifies the queries into a table (:func:`sparse_query_table`) that puts the G * Tq query rows of a KV head
  (G = Hq / Hkv) side by side under each coordinate; then one program per (batch, KV head, chunk of keys) takes all
  of them, so every code and every V row is read from memory once. The score tile is [keys, rows], one key per
  thread: per code t < topk the thread unpacks index t of its key and loads value t once, and one vector load
  fetches the rows' table entries at that index (8 bytes at 4 bfloat16 rows; the table, 1 KiB, stays in L1):
  score = scale * sum_t q~[idx_t] * val_t, the dot of the sparse query with the densified key, which is never
  built. The tile stays keys-major through the online softmax and P @ V, issued as V^T @ P^T on tensor cores
  (:func:`..triton_common.softmax_step`); the V tile comes through the TMA copy engine where the GPU has one. The
  chunks' partials merge by log-sum-exp.

Count per cached token and KV head (D = 128, topk = 16, bfloat16, G = 4, b = :func:`.cache.index_bits` (D) = 7):

- bytes from memory: topk * b / 8 = 14 of packed indices, topk * 2 = 32 of values, D * 2 = 256 of V: 302, against
  2 * D * 2 = 512 for dense K and V (1.70x fewer). Per decode step over 128K tokens and 8 KV heads: 316.7 MB (dense
  536.9 MB) -> 83 us at 3.8 TB/s, plus the float32 partials the merge reads back (2.1 MB at 8 programs per SM).
- work: topk index unpacks and value loads, topk vector loads of the table and G * topk = 64 float32 FMAs for the
  scores, G exponentials, and P @ V: G * D = 512 useful MACs, one [D, BLOCK_N] x [BLOCK_N, 8] MMA per tile (the 4
  rows padded to the MMA's 8: 16 HMMAs per 32-key tile). The sm_90 SASS of the main loop (triton 3.6, 32-key tiles,
  one warp, V through pointers) is 885 instructions per tile, 28 per token and KV head; rows-major tiles with P in
  two 16-bit halves (v6-v7) took 1076, 64 of them HMMAs and about 200 register moves for their padded A fragments.

MEASURED (H200, 128K cached tokens, GQA 32/8, CUDA-graph replays; benchmarks/results/sfa_h200/NOTES.md, v8): topk =
16 0.106 ms, 1.30x dense SDPA-cuDNN decode (0.138 ms; the v6 kernel beside it 0.119, 1.17x); topk = 8 0.096 ms,
1.44x (v6: 0.105). The target, 1.5x at topk = 16, needs 0.092 ms. One-warp programs of 32 keys, 3 stages and 8 per
SM still measure best: 158 registers would allow 12, but the 3 stages' 27 KB of shared memory hold 8 per SM, and
2 stages at 10-12 per SM were slower (0.108-0.121 ms). Triton's software pipeline stages every code's table gather
and value word through shared memory with the V tile, which caps the stages (:func:`_pipeline_stages`).
"""
from __future__ import annotations

import torch

from ..._checks import check_choice, check_no_nan, fail, resolve_scale
from ...config import SFA_DECODE_BACKENDS
from .. import split_k
from ..split_k import program_rows, store_rows
from ..triton_common import (choose_backend, is_interpreted, jit, kernel_blocker, on_device_of, softmax_finish,
                             softmax_start, softmax_step, triton)
from .cache import SFAKeyCache
from .codes import densify, sparsify

if triton is not None:
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor


# Measured on an H200 at 128K cached tokens, GQA 32/8, D = 128 (CUDA-graph replays; benchmarks/results/sfa_h200,
# v6): one warp per program and 32-key tiles beat 2-8 warps and 16- to 256-key tiles; 3 stages beat 1, 2 and 4;
# 8 programs per SM, one full wave at this kernel's 255 registers, beat 4-64 (k = 16, plain value loads: 0.123 ms
# at 8, 0.137 at 6 and 16, 0.174 at 10).
_BLOCK_N, _NUM_WARPS, _NUM_STAGES, _PROGRAMS_PER_SM = 32, 1, 3, 8
# Shared memory a pipelined launch may ask for (an H200 block gets 227 KiB; the dots' conversions need some).
_SHARED_BUDGET = 160 * 1024
# Elements of one densified key block (and of one score block) in the reference: 16 MiB in float32.
_BLOCK_ELEMENTS = 2 ** 22
# Coordinates compared per step when ranking a query's coordinates: a [D, 32] compare is 32 int32 per thread at
# D = 128 with 4 warps.
_SPARSIFY_BLOCK_V = 32


@jit
def _packed_index(key_bytes, key_ok, stride_byte, T: tl.constexpr, BITS: tl.constexpr):
    """Index T of each key of a tile, int32 [BLOCK_N]; key_bytes [BLOCK_N] points at each key's first packed byte,
    consecutive bytes ``stride_byte`` apart. Index T is bits [T * BITS, (T + 1) * BITS) of the key's bytes read as
    one little-endian integer (:func:`.cache.pack_indices`), so it lies in bytes T * BITS // 8 .. ((T + 1) * BITS -
    1) // 8, known at compile time: at most 3 of them for BITS <= 16 (2 for BITS <= 8, the kernel's D <= 256).

    Loads, per index: each of its bytes for the tile's keys, a gather at stride ``stride_byte`` whose BLOCK_N bytes
    lie in the tile's BLOCK_N * ceil(TOPK * BITS / 8) packed bytes (64 * 14 = 896 at D = 128, topk = 16: seven
    128-byte lines, read from memory once per tile, the later gathers hitting L1). A byte two neighbouring indices
    share is the same load (same address and mask), which the compiler merges: the sm_90 TTIR at D = 128, topk = 16
    has 14 byte loads per key, one per packed byte, against 16 for byte-wide indices. Loading the [BLOCK_N, bytes]
    tile once instead would leave each index to extract its bytes from registers with a select and a sum over the
    tile's columns, more work than these gathers."""
    tl.static_assert(BITS <= 16, "a packed index must span at most 3 bytes (int32 holds them)")
    FIRST: tl.constexpr = T * BITS // 8
    LAST: tl.constexpr = ((T + 1) * BITS - 1) // 8
    # Widened to int32 before shifting: shifts of uint8 would drop the high bits.
    word = tl.load(key_bytes + FIRST * stride_byte, mask=key_ok, other=0).to(tl.int32)
    for s in tl.static_range(FIRST + 1, LAST + 1):
        byte = tl.load(key_bytes + s * stride_byte, mask=key_ok, other=0).to(tl.int32)
        word = word | (byte << (8 * (s - FIRST)))
    return (word >> (T * BITS % 8)) & ((1 << BITS) - 1)


@jit
def _sparse_query_table(X, TABLE, stride_xb, stride_xh, stride_xt, stride_xd, heads, kv_heads, q_len, topk,
                        row_blocks, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (B * Hq * Tq,). Writes ``sparsify(X, topk)`` for X [B, Hq, Tq, D] (any strides, no NaN), one query row
    per program, into TABLE [B, Hkv, row_blocks, D, BLOCK_M] (contiguous, X's dtype): row r = (h % G) * Tq + i of KV
    head h // G (G = Hq / Hkv) goes to column r % BLOCK_M of row block r // BLOCK_M, so the BLOCK_M rows of one
    decode program lie side by side under each coordinate. Columns of no row (the last block's padding) are left
    as they are.

    Coordinate u keeps x_u iff fewer than topk coordinates v rank above it, v ranking above u when |x_v| > |x_u|,
    or |x_v| == |x_u| and v < u (the rule of :mod:`.codes`, ties to the lower index, so the same coordinates as its
    stable sort); the others become 0. The ranks are counted BLOCK_V coordinates v at a time ([D, BLOCK_V] compares
    per step). One launch in place of the sort, gather, fill and scatter of :func:`.codes.sparsify` (a decode step's
    fixed cost)."""
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
def _code_scores(table, key_bytes, key_words, key_ok, stride_ibyte, TOPK: tl.constexpr, INDEX_BITS: tl.constexpr,
                 PER_WORD: tl.constexpr, VALUE_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unscaled scores [BLOCK_N, BLOCK_M] float32 of a tile of cached keys against the program's query rows, read
    from the codes: s[j, m] = sum over t < TOPK of q~[m, idx[j, t]] * val[j, t], the dot of the zero-filled sparse
    query with the densified key, which is never built.

    table: the program's block of the query table, [D, BLOCK_M] contiguous (:func:`_sparse_query_table`);
    key_bytes [BLOCK_N]: each key's first packed index byte (bytes ``stride_ibyte`` apart); key_words [BLOCK_N]: its
    values as words (:func:`_code_value`); key_ok [BLOCK_N]: which keys exist (the others read index 0 and value 0,
    so they score 0).

    Keys along the first axis, rows along the second: one thread holds one key with all its rows, so each (key,
    code) is unpacked and loaded once and serves BLOCK_M rows, and the rows' q entries under the code's index are
    BLOCK_M neighbours in the table: one vector load (8 bytes at 4 bfloat16 rows), from a table of D * BLOCK_M
    elements (1 KiB) that stays in L1. The table's padding columns are 0 (their scores are masked anyway)."""
    m = tl.arange(0, BLOCK_M)
    s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for t in tl.static_range(TOPK):
        coord = _packed_index(key_bytes, key_ok, stride_ibyte, t, INDEX_BITS)  # 0 for a missing key: in bounds
        value = _code_value(key_words, key_ok, t, PER_WORD, VALUE_DTYPE)
        q_at = tl.load(table + coord[:, None] * BLOCK_M + m[None, :])
        # Products of 16-bit values are exact in float32, as in a tensor-core dot.
        s += q_at.to(tl.float32) * value[:, None]
    return s


@jit
def _sfa_decode_chunk(
    Q, TABLE, IDX, VAL, V, V_DESC, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_ib, stride_ih, stride_it, stride_ibyte,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_vd,
    kv_heads, group, q_len, k_len, scale, chunk_keys, num_chunks,
    HEAD_DIM: tl.constexpr, TOPK: tl.constexpr, INDEX_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PER_WORD: tl.constexpr, VALUE_DTYPE: tl.constexpr, NATIVE_DOT: tl.constexpr,
    V_TMA: tl.constexpr,
):
    """Grid (B * Hkv, chunks, row blocks). Q: the queries [B, Hq, Tq, D] (only their layout is read: the rows and
    positions); TABLE: their sparse query table [B, Hkv, row blocks, D, BLOCK_M] (:func:`_sparse_query_table`);
    IDX: the cached keys' packed indices uint8 [B, Hkv, Tk, ceil(TOPK * INDEX_BITS / 8)]
    (:func:`.cache.pack_indices`); VAL: their values [B, Hkv, Tk, TOPK] (VALUE_DTYPE) viewed as words of PER_WORD
    values [B, Hkv, Tk, TOPK / PER_WORD] (:func:`_code_value`); V [B, Hkv, Tk, D], read through V_DESC, its TMA
    descriptor in [1, 1, BLOCK_N, D] tiles (:func:`_v_tile_descriptor`), when V_TMA, else through its pointer and
    strides. BLOCK_M rows per program, any power of two (the rows are the N of the MMAs, which pad them to 8
    themselves: :func:`..triton_common.softmax_step`). Writes each row's output over the chunk's
    keys (normalised over them) and its log-sum-exp to O [B, Hq, Tq, chunks, D] and LSE [B, Hq, Tq, chunks]
    (float32, contiguous)."""
    # The scores read q through the table: program_rows' dense q tile goes unused, and the compiler drops its load.
    b, kv_head, r, row_ok, q_pos, d, _, _, start, stop = program_rows(
        Q, stride_qb, stride_qh, stride_qt, stride_qd, kv_heads, group, q_len, k_len, chunk_keys, BLOCK_M, HEAD_DIM)
    table = TABLE + ((b * kv_heads + kv_head) * tl.num_programs(2) + tl.program_id(2)) * (HEAD_DIM * BLOCK_M)
    idx_head = IDX + b * stride_ib + kv_head * stride_ih
    val_head = VAL + b * stride_kb + kv_head * stride_kh
    v_head = V + b * stride_vb + kv_head * stride_vh

    acc_t, l_i, m_i = softmax_start(BLOCK_M, HEAD_DIM)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        key_ok = n < stop
        s = _code_scores(table, idx_head + n * stride_it, val_head + n * stride_kt, key_ok, stride_ibyte, TOPK,
                         INDEX_BITS, PER_WORD, VALUE_DTYPE, BLOCK_M, BLOCK_N)
        s = tl.where(key_ok[:, None] & row_ok[None, :] & (n[:, None] <= q_pos[None, :]), scale * s, float("-inf"))
        if V_TMA:
            v_t = tl.trans(V_DESC.load([b.to(tl.int32), kv_head.to(tl.int32), n0, 0]).reshape(BLOCK_N, HEAD_DIM))
        else:
            v_t = tl.load(v_head + n[None, :] * stride_vt + d[:, None] * stride_vd, mask=key_ok[None, :], other=0.0)
        acc_t, l_i, m_i = softmax_step(acc_t, l_i, m_i, s, v_t, NATIVE_DOT)

    # A row may have no key in this chunk (a query before the chunk's keys): output 0 and log-sum-exp -inf.
    out, lse = softmax_finish(acc_t, l_i, m_i)
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
        backend: "reference" (PyTorch), "triton" (CUDA, or the interpreter with TRITON_INTERPRET=1; float16,
            bfloat16 or float32, D a power of two in [16, 256]) or "auto" (triton on CUDA when it can, else the
            reference).

    Returns out [B, Hq, Tq, D] (q's dtype) and lse [B, Hq, Tq] (float32, natural log), equal to
    ``sfa_attention_reference(q, K, V, topk=cache.topk, causal=True, scale=scale)`` with K the dense keys the cache
    was built from and V its values.
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
    return choose_backend(backend, q, kernel_blocker(q))


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
        keys = densify(*cache.keys(start, stop), head_dim).to(compute_dtype)  # unpacks this block only
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
    work = split_k.plan(batch, q_heads, kv_heads, q_len, k_len, q.device, block_n=_BLOCK_N,
                        programs_per_sm=_PROGRAMS_PER_SM)
    packed, values = cache.packed_keys()
    words = _value_words(values)
    v = cache.values()
    v_tiles = _v_tile_descriptor(v)
    part_out, part_lse = split_k.partials(q, work.chunks)
    # The merge rounds to q's dtype itself on GPUs; the interpreter truncates float32 -> 16-bit casts, so there it
    # merges in float32 and torch rounds.
    out = torch.empty(q.shape, dtype=torch.float32 if _INTERPRETED else q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with on_device_of(q):
        table = sparse_query_table(q, cache.topk, kv_heads, work.block_m)
        _sfa_decode_chunk[(batch * kv_heads, work.chunks, work.row_blocks)](
            q, table, packed, words, v, v_tiles, part_out, part_lse,
            *q.stride(), *packed.stride(), *words.stride()[:3], *v.stride(),
            kv_heads, q_heads // kv_heads, q_len, k_len, scale, work.chunk_keys, work.chunks,
            HEAD_DIM=head_dim, TOPK=cache.topk, INDEX_BITS=cache.index_bits, BLOCK_M=work.block_m,
            BLOCK_N=_BLOCK_N, PER_WORD=words.element_size() // values.element_size(),
            VALUE_DTYPE=getattr(tl, str(values.dtype).removeprefix("torch.")),
            NATIVE_DOT=q.dtype != torch.float32 and not _INTERPRETED, V_TMA=v_tiles is not None,
            num_warps=_NUM_WARPS,
            num_stages=_pipeline_stages(cache.topk, work.block_m, head_dim, q.element_size()))
        split_k.merge(part_out, part_lse, out, lse)
    return out.to(q.dtype), lse


def _v_tile_descriptor(v: torch.Tensor):
    """A TMA descriptor of V [B, Hkv, T, D] in [1, 1, _BLOCK_N, D] tiles where the copy engine can serve it (a GPU of
    compute capability 9 or more, or the interpreter; the base and every stride but the unit last one multiples of
    16 bytes, as a cache's V is), else None (the kernel then loads V through pointers). Rows past T read 0.

    Why: the tile then costs one copy instruction rather than a masked 16-byte copy with its address per thread and
    row: with it the step at 128K, topk = 16 took 0.106 rather than 0.110 ms (v8)."""
    capable = _INTERPRETED or torch.cuda.get_device_capability(v.device)[0] >= 9
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


def _pipeline_stages(topk: int, block_m: int, head_dim: int, itemsize: int) -> int:
    """_NUM_STAGES, or 1 where the software pipeline's buffers would not fit in shared memory: Triton stages each
    code's query-table gather besides the V tile and the value words, (stages - 1) * (topk * block_m + D + topk) *
    _BLOCK_N elements (an upper bound: Triton 3.9 stages fewer of the 16-bit gathers than 3.6)."""
    staged = (_NUM_STAGES - 1) * (topk * block_m + head_dim + topk) * _BLOCK_N * itemsize
    return _NUM_STAGES if staged <= _SHARED_BUDGET else 1


def sparse_query_table(q: torch.Tensor, topk: int, kv_heads: int, block_m: int) -> torch.Tensor:
    """:func:`.codes.sparsify` (q, topk) of q [B, Hq, Tq, D] (D a power of two, no NaN), laid out for the decode
    kernel by one launch: a new tensor [B, Hkv, ceil(G * Tq / block_m), D, block_m] of q's dtype (G = Hq / Hkv)
    whose [b, h // G, r // block_m, :, r % block_m] is sparsify(q)[b, h, i] for r = (h % G) * Tq + i, element for
    element; the last block's columns past G * Tq are 0. Call within q's device."""
    batch, heads, q_len, head_dim = q.shape
    rows = heads // kv_heads * q_len
    row_blocks = triton.cdiv(rows, block_m)
    # Zeros only where a padding column exists (one more launch); the kernel writes every other element.
    allocate = torch.empty if rows % block_m == 0 else torch.zeros
    table = allocate(batch, kv_heads, row_blocks, head_dim, block_m, dtype=q.dtype, device=q.device)
    _sparse_query_table[(batch * heads * q_len,)](q, table, *q.stride(), heads, kv_heads, q_len, topk, row_blocks,
                                                  HEAD_DIM=head_dim, BLOCK_M=block_m,
                                                  BLOCK_V=min(head_dim, _SPARSIFY_BLOCK_V))
    return table
