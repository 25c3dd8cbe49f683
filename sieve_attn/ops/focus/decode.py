"""Triton decode kernel of the hard Focus pattern: a few new queries against a long KV cache.

Flash-decoding split-K. The keys are cut into chunks; one program takes one (batch, KV head, chunk) and every query
row of that KV head (its Hq // Hkv query heads times the Tq queries), so K and V are read once per KV head and never
copied per query head. A program streams its chunk in tiles of BLOCK_N keys: it loads the tile's group bit sets,
builds the pair mask of its rows, and loads a K/V row only where some row attends that key. Each chunk leaves a
partial (output, log-sum-exp) and a small second kernel merges the chunks by log-sum-exp.

Bytes read: 8 bytes of ``bits`` per cached token and KV head (repeats across heads are usually served by L2), plus
the K and V rows of attended keys only: a masked-off row costs no memory traffic. Compute is not skipped: every tile
still goes through both dots (skipping empty tiles with a branch measured slower on an H200, and with groups spread
over the sequence few tiles are empty anyway).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..triton_common import dot, is_interpreted, softmax_finish, softmax_step, tanh

# Split-K targets this many programs per SM: several resident programs hide each other's load latency, and chunks
# that finish early (fewer attended keys) leave no SM idle for long. 8 measured best on an H200 (4 and 16 slower).
_PROGRAMS_PER_SM = 8
# Without a GPU (the Triton interpreter) chunking follows an H200, so CPU tests see the GPU's split.
_DEFAULT_SMS = 132
# Query rows per program; more rows (GQA groups times speculative queries) are split across programs, each of which
# reads the K/V its rows need.
_MAX_BLOCK_M = 64
# Keys per tile, warps and pipeline depth, measured on an H200 (D = 64, 128 and 256; 32-key tiles, 8 warps and 2 or 4
# stages were slower).
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 3
# Chunks merged per step of the merge kernel.
_MERGE_CHUNKS = 16


@triton.jit
def _focus_decode_chunk(
    Q, K, V, BITS, O, LSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_bits_b, stride_bits_t,
    kv_heads, group, q_len, k_len, window, scale, softcap, chunk_keys, num_chunks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    """Grid (B * Hkv, chunks, row blocks). Writes the chunk's normalized output and log-sum-exp of each row to
    O [B, Hq, Tq, chunks, D] and LSE [B, Hq, Tq, chunks] (contiguous; chunks = 1 writes the final tensors)."""
    pid_bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (pid_bh // kv_heads).to(tl.int64)
    kv_head = (pid_bh % kv_heads).to(tl.int64)
    rows = group * q_len
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # row r is query i = r % Tq of head r // Tq in the group
    row_ok = r < rows
    q_head = kv_head * group + r // q_len
    i = r % q_len
    q_pos = k_len - q_len + i
    d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + b * stride_qb + q_head[:, None] * stride_qh + i[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    bits_row = BITS + b * stride_bits_b
    q_bits = tl.load(bits_row + q_pos * stride_bits_t, mask=row_ok, other=0)
    k_head = K + b * stride_kb + kv_head * stride_kh
    v_head = V + b * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start = chunk * chunk_keys
    stop = tl.minimum(start + chunk_keys, k_len)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k_bits = tl.load(bits_row + n * stride_bits_t, mask=n < stop, other=0)
        distance = q_pos[:, None] - n[None, :]
        # Causal (distance >= 0) also drops the keys past the cache end: every query sits before k_len.
        pair = row_ok[:, None] & (distance >= 0) & ((distance <= window) | ((q_bits[:, None] & k_bits[None, :]) != 0))
        needed = tl.max(pair.to(tl.int32), axis=0) > 0  # [BLOCK_N]: some row of this program attends the key
        k = tl.load(k_head + n[:, None] * stride_kt + d[None, :] * stride_kd, mask=needed[:, None], other=0.0)
        v = tl.load(v_head + n[:, None] * stride_vt + d[None, :] * stride_vd, mask=needed[:, None], other=0.0)
        s = dot(q, tl.trans(k), NATIVE_DOT) * scale
        if SOFTCAP:
            s = softcap * tanh(s / softcap)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, tl.where(pair, s, float("-inf")), v, NATIVE_DOT)

    out, lse = softmax_finish(acc, l_i, m_i)
    out_row = (pid_bh.to(tl.int64) * rows + r) * num_chunks + chunk
    tl.store(LSE + out_row, lse, mask=row_ok)
    tl.store(O + out_row[:, None] * HEAD_DIM + d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _focus_decode_merge(O_PART, LSE_PART, O, LSE, num_chunks,
                        HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, MERGE_CHUNKS: tl.constexpr):
    """Grid (B * Hq * Tq,). Merges one row's chunks: O_PART [rows, chunks, D] and LSE_PART [rows, chunks] float32
    into O [rows, D] (dtype of q) and LSE [rows] float32."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    lse_c = tl.load(LSE_PART + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    m = tl.max(lse_c, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse_c - m_safe), axis=0)  # >= 1 unless every chunk is empty (then 0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for c0 in range(0, num_chunks, MERGE_CHUNKS):
        cc = c0 + tl.arange(0, MERGE_CHUNKS)
        ok = cc < num_chunks
        w = tl.exp(tl.load(LSE_PART + row * num_chunks + cc, mask=ok, other=float("-inf")) - m_safe)
        o = tl.load(O_PART + (row * num_chunks + cc[:, None]) * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    tl.store(LSE + row, tl.where(total > 0, m_safe + tl.log(tl.maximum(total, 1.0)), float("-inf")))
    tl.store(O + row * HEAD_DIM + d, (acc / tl.maximum(total, 1.0)).to(O.dtype.element_ty))


_INTERPRETED = is_interpreted(_focus_decode_chunk)


def _split(programs: int, k_len: int, block_n: int, sms: int) -> tuple[int, int]:
    """(keys per chunk, chunks): about ``_PROGRAMS_PER_SM * sms`` programs in all, each chunk a whole number of
    tiles. ``programs``: programs per chunk index (B * Hkv * row blocks)."""
    tiles = triton.cdiv(k_len, block_n)
    chunks = max(1, min(tiles, triton.cdiv(_PROGRAMS_PER_SM * sms, programs)))
    tiles_per_chunk = triton.cdiv(tiles, chunks)
    return tiles_per_chunk * block_n, triton.cdiv(tiles, tiles_per_chunk)


def focus_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, *, window: int,
                 scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard-group Focus attention of a few decode queries against the whole KV cache (Triton).

    Args:
        q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] (the cache, new tokens included), Hq % Hkv == 0; query head h reads
            KV head h // (Hq // Hkv). One float dtype (float16, bfloat16 or float32), D in {16, 32, 64, 128, 256}, any
            strides. Tq is small (decode steps); query i sits at key position Tk - Tq + i.
        bits: int64 [B, Tk], each token's group bit set (:func:`~sieve_attn.ops.focus.reference.group_bits`).
        window: key j is local to query i when 0 <= i - j <= window.
        scale: logits are scale * q.k in float32. softcap: logits become softcap * tanh(logit / softcap).

    Pair (i, j) is attended iff j <= i and (i - j <= window or bits[b, i] & bits[b, j] != 0), exactly as
    :func:`~sieve_attn.ops.focus.reference.focus_attention_reference` with ``causal=True``. Products and
    accumulation are as accurate as float32 for every input dtype.

    Returns out [B, Hq, Tq, D] (dtype of q) and lse [B, Hq, Tq] (float32, natural log). A row with no attended key
    (impossible here: j = i is always local) would get 0 and -inf, as in FlashAttention.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    assert q_heads % kv_heads == 0 and 1 <= q_len <= k_len and head_dim in (16, 32, 64, 128, 256)
    assert k.dtype == v.dtype == q.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert bits.dtype == torch.int64 and bits.shape == (batch, k_len)
    group = q_heads // kv_heads
    rows = group * q_len
    block_m = max(16, min(_MAX_BLOCK_M, triton.next_power_of_2(rows)))  # tl.dot needs 16 rows
    row_blocks = triton.cdiv(rows, block_m)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else _DEFAULT_SMS
    chunk_keys, chunks = _split(batch * kv_heads * row_blocks, k_len, _BLOCK_N, sms)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    if chunks == 1:
        part_out, part_lse = out, lse
    else:
        part_out = torch.empty(batch, q_heads, q_len, chunks, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, q_heads, q_len, chunks, dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _focus_decode_chunk[(batch * kv_heads, chunks, row_blocks)](
            q, k, v, bits, part_out, part_lse,
            *q.stride(), *k.stride(), *v.stride(), *bits.stride(),
            kv_heads, group, q_len, k_len, min(window, k_len), scale, 1.0 if softcap is None else softcap,
            chunk_keys, chunks,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, SOFTCAP=softcap is not None,
            NATIVE_DOT=q.dtype != torch.float32 and not _INTERPRETED, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
        if chunks > 1:
            _focus_decode_merge[(batch * q_heads * q_len,)](
                part_out, part_lse, out, lse, chunks,
                HEAD_DIM=head_dim, BLOCK_C=triton.next_power_of_2(chunks), MERGE_CHUNKS=_MERGE_CHUNKS)
    return out, lse
