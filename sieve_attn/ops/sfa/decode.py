"""SFA decode step: a few new queries against the compressed key cache (:class:`.cache.SFAKeyCache`).

The queries are sparsified per query head with the rule every SFA path shares (:mod:`.codes`); the score of a query
and a cached key is ``scale * sum over the coordinates both keep of q~_u * k~_u``, then causal softmax and P.V with
the dense cached V: exactly :func:`.reference.sfa_attention_reference` (q, K, V, causal=True) where K are the dense
keys the cache was built from. Two backends compute it:

- ``reference``: plain PyTorch. Unpacks and densifies the cached keys one block at a time (never the whole cache)
  and runs an online softmax over the blocks.
- ``triton``: flash-decoding split-K (:mod:`sieve_attn.ops.split_k`), bound by the bytes of the cache. One launch
  sparsifies the queries (:func:`sparsify_triton`); then one program per (batch, KV head, chunk of keys) takes all
  G = Hq / Hkv query heads (times Tq) of its KV head, so every code and every V row is read from memory once. Per
  tile of BLOCK_N keys and per code t < topk it unpacks index t of each key (once per (key, code), shared by the
  G rows), loads value t, and gathers the G rows' sparse-query entries at those indices: score = scale * sum_t
  q~[idx_t] * val_t, the dot of the sparse query with the densified key, which is never built. q~ is G * D
  elements per program (1 KiB at G = 4, D = 128, bfloat16), so the gathers hit L1. Then the online softmax and P @ V
  on tensor cores as the Focus decode kernel does, and the chunks' partials merge by log-sum-exp.

Count per cached token and KV head (D = 128, topk = 16, bfloat16, G = 4, b = :func:`.cache.index_bits` (D) = 7):

- bytes from memory: topk * b / 8 = 14 of packed indices, topk * 2 = 32 of values, D * 2 = 256 of V: 302, against
  2 * D * 2 = 512 for dense K and V (1.70x fewer). Per decode step over 128K tokens and 8 KV heads: 316.7 MB (dense
  536.9 MB), plus 2.2 MB of float32 partials written and read back by the merge (4 rows * 132 chunks * 129 floats
  per KV head).
- work: topk index unpacks (~6 integer ops each), topk value loads, G * topk = 64 gathers and float32 FMAs for the
  scores, G exponentials, and P @ V: G * D = 512 useful MACs, issued as two [16, BLOCK_N] x [BLOCK_N, D] MMAs per
  tile (rows padded to the MMA's 16, P split in two bfloat16 halves to keep float32 accuracy). The sm_90 SASS of
  the main loop (triton 3.9, ptxas of the install) is 732 instructions per thread per 64-key tile with 4 warps:
  46 warp instructions per token and KV head, 128 registers, no spills (the former densifying kernel: 13.5 KB of
  stack per thread at this shape).

PREDICTION (made before the first GPU run), H200, batch 1, 32 query / 8 KV heads, Tq = 1, 128K tokens, D = 128, topk =
16: bytes / 3.8 TB/s = 83 us. Issue: 1.05M token-heads * 46 warp instructions over 132 SMs is 363K per SM, 61 us
at 3 instructions per clock (1.98 GHz), 92 us at 2, so the loop should stay just under memory-bound given enough
instruction throughput (4 programs of 4 warps resident per SM at 128 registers; 1056 programs make two full
waves; each keeps one 16 KiB V tile in flight through cp.async besides its code loads, about 76 KiB per SM, above
the ~25 KiB that 3.8 TB/s at ~0.8 us latency needs). Fixed costs: the sparsifying launch, the main launch's ramp
and tail and the merge, about 3 us each. Predicted total: about 0.095 ms (0.09 to 0.11 ms), against 0.139 ms
measured for dense SDPA: 1.3x to 1.5x faster, short of or at the 1.5x target; the byte bound alone allows 1.68x.
MEASURED (benchmarks/results/sfa_h200/NOTES.md, v4, CUDA graphs): 0.172 ms (k = 8: 0.136 ms), 1.8x the prediction.
Storing the codes code-major, which cuts the memory lines of each per-code load from 4-8 to 1, measured slower
(0.207 ms, v5), so those loads are not the limit; not profiled.
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


# Measured on an H200 at 128K cached tokens, GQA 32/8, D = 128 (CUDA-graph replays; benchmarks/results/sfa_h200,
# v4): 3 stages beat 2 (k = 16: 0.171 vs 0.183 ms; k = 8: 0.135 vs 0.147); 8 warps and 32- or 128-key tiles were
# slower.
_NUM_WARPS, _NUM_STAGES = 4, 3
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
def _sparsify_rows(X, Y, stride_xb, stride_xh, stride_xt, stride_xd, heads, q_len, topk,
                   HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (B * Hq * Tq,). Writes Y [B, Hq, Tq, D] (contiguous, X's dtype) = ``sparsify(X, topk)`` for X
    [B, Hq, Tq, D] (any strides, no NaN), one row per program: coordinate u keeps x_u iff fewer than topk
    coordinates v rank above it, v ranking above u when |x_v| > |x_u|, or |x_v| == |x_u| and v < u (the rule of
    :mod:`.codes`, ties to the lower index, so the same coordinates as its stable sort); the others become 0.

    One launch in place of the sort, gather, fill and scatter of :func:`.codes.sparsify` (a decode step's fixed
    cost). The ranks are counted BLOCK_V coordinates v at a time ([D, BLOCK_V] compares per step)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row // (heads * q_len) * stride_xb + row // q_len % heads * stride_xh + row % q_len * stride_xt
    u = tl.arange(0, HEAD_DIM)
    x = tl.load(x_row + u * stride_xd)
    size_u = tl.abs(x.to(tl.float32))[:, None]  # exact for every input dtype
    rank = tl.zeros([HEAD_DIM], tl.int32)
    for v0 in range(0, HEAD_DIM, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        size_v = tl.abs(tl.load(x_row + v * stride_xd).to(tl.float32))[None, :]
        above = (size_v > size_u) | ((size_v == size_u) & (v[None, :] < u[:, None]))
        rank += tl.sum(above.to(tl.int32), axis=1)
    tl.store(Y + row * HEAD_DIM + u, tl.where(rank < topk, x, tl.zeros_like(x)))


@jit
def _code_scores(q_rows, row_ok, key_bytes, key_values, key_ok, stride_qd, stride_ibyte, stride_kk,
                 TOPK: tl.constexpr, INDEX_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unscaled scores [BLOCK_M, BLOCK_N] float32 of the program's rows against a tile of cached keys, read from
    the codes: s[m, j] = sum over t < TOPK of q~[m, idx[j, t]] * val[j, t], i.e. the dot of the zero-filled sparse
    query with the densified key, without densifying it.

    q_rows [BLOCK_M]: the rows of the zero-filled sparse queries (coordinates ``stride_qd`` apart), row_ok which of
    them exist; key_bytes [1, BLOCK_N]: each key's first packed index byte (bytes ``stride_ibyte`` apart);
    key_values [1, BLOCK_N]: its first value (values ``stride_kk`` apart); key_ok [1, BLOCK_N]: which keys exist
    (the others score 0). The key operands are [1, BLOCK_N], not [BLOCK_N], so that their loads take the score
    tile's layout: 1-d loads cost two layout conversions through shared memory (and a barrier) per code on sm_90.

    Each (key, code) pair is unpacked and loaded once per thread that holds its column (the threads of a column
    differ only in the rows they gather), then serves its BLOCK_M rows; the rows' q entries are gathered by
    address. q is [BLOCK_M, D] per program (1 KiB at 4 heads, D = 128, bfloat16), so after the first
    tile every gather hits L1: HBM sees only the codes."""
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in tl.static_range(TOPK):
        coord = _packed_index(key_bytes, key_ok, stride_ibyte, t, INDEX_BITS)  # 0 for a missing key: in bounds
        value = tl.load(key_values + t * stride_kk, mask=key_ok, other=0.0).to(tl.float32)
        q_at = tl.load(q_rows[:, None] + coord * stride_qd, mask=row_ok[:, None], other=0.0)
        # Products of 16-bit values are exact in float32, as in a tensor-core dot.
        s += q_at.to(tl.float32) * value
    return s


@jit
def _sfa_decode_chunk(
    Q, IDX, VAL, V, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_ib, stride_ih, stride_it, stride_ibyte,
    stride_kb, stride_kh, stride_kt, stride_kk,
    stride_vb, stride_vh, stride_vt, stride_vd,
    kv_heads, group, q_len, k_len, scale, chunk_keys, num_chunks,
    HEAD_DIM: tl.constexpr, TOPK: tl.constexpr, INDEX_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    """Grid (B * Hkv, chunks, row blocks). Q: the zero-filled sparse queries [B, Hq, Tq, D]; IDX: the cached keys'
    packed indices uint8 [B, Hkv, Tk, ceil(TOPK * INDEX_BITS / 8)] (:func:`.cache.pack_indices`); VAL: their values
    [B, Hkv, Tk, TOPK]; V [B, Hkv, Tk, D]. BLOCK_M rows per program (any power of two: P @ V pads a dot of fewer
    than 16 rows itself). Writes each row's output over the chunk's keys (normalised over them) and its
    log-sum-exp to O [B, Hq, Tq, chunks, D] and LSE [B, Hq, Tq, chunks] (float32, contiguous)."""
    # The scores gather q by address through q_rows: program_rows' dense q tile goes unused.
    b, kv_head, r, row_ok, q_pos, d, _, q_rows, start, stop = program_rows(
        Q, stride_qb, stride_qh, stride_qt, stride_qd, kv_heads, group, q_len, k_len, chunk_keys, BLOCK_M, HEAD_DIM)
    idx_head = IDX + b * stride_ib + kv_head * stride_ih
    val_head = VAL + b * stride_kb + kv_head * stride_kh
    v_head = V + b * stride_vb + kv_head * stride_vh

    acc, l_i, m_i = softmax_start(BLOCK_M, HEAD_DIM)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        key_ok = n < stop
        key = n[None, :]
        s = scale * _code_scores(q_rows, row_ok, idx_head + key * stride_it, val_head + key * stride_kt, key < stop,
                                 stride_qd, stride_ibyte, stride_kk, TOPK, INDEX_BITS, BLOCK_M, BLOCK_N)
        s = tl.where(row_ok[:, None] & key_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        v = tl.load(v_head + n[:, None] * stride_vt + d[None, :] * stride_vd, mask=key_ok[:, None], other=0.0)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, NATIVE_DOT)

    # A row may have no key in this chunk (a query before the chunk's keys): output 0 and log-sum-exp -inf.
    out, lse = softmax_finish(acc, l_i, m_i)
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

    Returns out [B, Hq, Tq, D] (q's dtype) and lse [B, Hq, Tq] (float32). Products and accumulation are as accurate
    as float32 for every input dtype."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = cache.kv_heads, cache.length
    work = split_k.plan(batch, q_heads, kv_heads, q_len, k_len, q.device)
    # The plan's row blocks hold at least 16 rows (what a dot of q against K needs); the scores here are gathers,
    # so a program takes just its rows rounded up to a power of two (4 for 32 query heads over 8 KV heads, Tq = 1)
    # and issues no loads for padding rows. Same grid: below 16 rows there is one row block either way.
    block_m = min(work.block_m, triton.next_power_of_2(q_heads // kv_heads * q_len))

    packed, values = cache.packed_keys()
    v = cache.values()
    part_out, part_lse = split_k.partials(q, work.chunks)
    # The merge rounds to q's dtype itself on GPUs; the interpreter truncates float32 -> 16-bit casts, so there it
    # merges in float32 and torch rounds.
    out = torch.empty(q.shape, dtype=torch.float32 if _INTERPRETED else q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with on_device_of(q):
        q_sparse = sparsify_triton(q, cache.topk)
        _sfa_decode_chunk[(batch * kv_heads, work.chunks, work.row_blocks)](
            q_sparse, packed, values, v, part_out, part_lse,
            *q_sparse.stride(), *packed.stride(), *values.stride(), *v.stride(),
            kv_heads, q_heads // kv_heads, q_len, k_len, scale, work.chunk_keys, work.chunks,
            HEAD_DIM=head_dim, TOPK=cache.topk, INDEX_BITS=cache.index_bits, BLOCK_M=block_m,
            BLOCK_N=split_k.BLOCK_N, NATIVE_DOT=q.dtype != torch.float32 and not _INTERPRETED, num_warps=_NUM_WARPS,
            num_stages=_NUM_STAGES)
        split_k.merge(part_out, part_lse, out, lse)
    return out.to(q.dtype), lse


def sparsify_triton(q: torch.Tensor, topk: int) -> torch.Tensor:
    """:func:`.codes.sparsify` (q, topk) of q [B, Hq, Tq, D] (D a power of two, no NaN) by one kernel launch:
    a new contiguous tensor of q's dtype, equal to it element for element. Call within q's device."""
    y = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch, heads, q_len, head_dim = q.shape
    _sparsify_rows[(batch * heads * q_len,)](q, y, *q.stride(), heads, q_len, topk, HEAD_DIM=head_dim,
                                             BLOCK_V=min(head_dim, _SPARSIFY_BLOCK_V))
    return y
