"""Flash-decoding split-K, shared by the decode kernels (Focus, SFA over a compressed cache).

A decode step has few query rows and many keys, so the keys are cut into chunks: one program takes one (batch, KV
head, chunk, row block), where a KV head's rows are its Hq // Hkv query heads times the Tq queries, so K and V are
read once per KV head and never copied per query head. Each program leaves a float32 partial (output normalised over
the keys it took: its chunk's, and in a kernel with a pool the units it took from it; log-sum-exp); the partials merge
by log-sum-exp, exactly for any partition of the keys. This module holds the plan (how many chunks and rows per
program), the kernels' common prologue and epilogue, and the merge.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_common import hopper_or_newer, is_interpreted, jit, triton, wait_for_prior_kernel

if triton is not None:
    import triton.language as tl

# Without a GPU (the Triton interpreter) chunking follows an H200, so CPU tests see the GPU's split.
_DEFAULT_SMS = 132
# Query rows per program; more rows (GQA groups times speculative queries) are split across programs.
_MAX_BLOCK_M = 64
# The merge kernel's step: chunks per step, and the coordinates of a row one program merges. v9: a decode step's
# rows are few (32 at GQA 32/8), so one program per row walked its ~128 chunks in 8 dependent steps of 16; 32
# coordinates per program and 64 chunks per step give 4x the programs and 2 steps. v11 (session 27, SFA decode at
# 128K, gated, 5 interleaved rounds): 256 chunks per step, one step at the H200's ~132 chunks, took the step from
# 0.0958 to 0.0939 ms at topk = 16 and from 0.0890 to 0.0873 at topk = 8 (128 per step: 0.0952 / 0.0874; 16
# coordinates per program: 0.0944 / 0.0871). Session 48 (H100, 128K, gated, 5 interleaved rounds): the one-pass
# merge (:func:`_merge_kernel`) took topk = 8 from 0.1128 to 0.1121 ms, topk = 16 0.1205 -> 0.1204 (within noise).
_MERGE_CHUNKS, _MERGE_D = 256, 32
# What the driver keeps of an SM's shared memory for each resident block (sm_80 and later: 1 KiB); torch's
# shared_memory_per_multiprocessor counts it in.
_RESERVED_SHARED = 1024
# Registers go to a warp in units of 256 (8 per thread).
_REGISTER_UNIT = 256
# Programs one SM holds of a compiled kernel: {(device index, kernel, options, argument dtypes): count}.
_HELD: dict = {}


@dataclass(frozen=True)
class Plan:
    """block_m rows per program (the KV head's rows rounded up to a power of two, at most 64: the kernels take their
    rows as the N of keys-major MMAs, which pad them to 8 themselves), row_blocks programs per (batch, KV head,
    chunk), chunk_keys keys per chunk: chunk c holds keys [c * chunk_keys, (c + 1) * chunk_keys) (the last one cut
    at Tk), and keys from chunks * chunk_keys on are a kernel's pool (none unless planned with ``pooled``; then
    chunk_keys may be 0, every key pooled, where there are fewer tiles than about chunks / (1 - pooled))."""

    block_m: int
    row_blocks: int
    chunk_keys: int
    chunks: int


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; an H200's count off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _DEFAULT_SMS


def programs_an_sm_holds(shared: int, registers: int, warps: int, sm_shared: int, sm_registers: int,
                         sm_threads: int) -> int:
    """Programs of a kernel that one SM holds at once, each taking ``shared`` bytes of shared memory (plus the
    driver's reserve of 1 KiB per block) and ``registers`` per thread (given to each of its ``warps`` warps in units
    of 256), of the SM's ``sm_shared`` bytes, ``sm_registers`` registers and ``sm_threads`` threads (0 where one
    program does not fit)."""
    per_warp = -(-registers * 32 // _REGISTER_UNIT) * _REGISTER_UNIT
    return min(sm_shared // (shared + _RESERVED_SHARED), sm_registers // max(1, per_warp * warps),
               sm_threads // (32 * warps))


def programs_per_sm(kernel, args: tuple, options: dict, device: torch.device, wanted: int) -> int:
    """``wanted``, or fewer where one SM of ``device`` cannot hold that many programs of ``kernel`` (a Triton JIT
    function) compiled for its positional ``args`` (a tensor may be given as its dtype) and ``options`` (its
    constexprs and launch options, num_warps among them): :func:`programs_an_sm_holds` of the compiled kernel's
    shared memory and registers. Off CUDA and under the interpreter, ``wanted``. The count is kept per device,
    options and argument dtypes (Triton keeps the compiled kernel); where a Triton compile hook returns no kernel,
    ``wanted``.

    Why: :func:`plan` lays out whole waves of ``programs_per_sm`` programs per SM, all running at once; where an SM
    holds fewer, the programs past them run a whole chunk each after the others, on SMs otherwise idle. SFA decode
    planned 8 per SM at D = 128, which its shared memory fits at topk = 16 (27.9 KiB each with Triton 3.6), but only 7
    at topk = 20 and 6 at topk = 24: on an H100 (session 49) its step at 128K took 0.161 and 0.158 ms there against
    0.121 at topk = 16, for 4% and 8% more bytes; planned for what an SM holds (session 50, same H100 type, gated
    bench), 0.124 and 0.130 ms."""
    if device.type != "cuda" or is_interpreted(kernel):
        return wanted
    key = (device.index, kernel, tuple(sorted(options.items())),
           tuple(a if isinstance(a, torch.dtype) else getattr(a, "dtype", type(a)) for a in args))
    if key not in _HELD:
        compiled = kernel.warmup(*args, grid=(1,), **options)
        if compiled is None:  # a Triton compile hook took the compile over: nothing to count
            return wanted
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # Triton's asynchronous compile
        compiled._init_handles()  # loads the binary, which is what reports its registers
        props = torch.cuda.get_device_properties(device)
        _HELD[key] = programs_an_sm_holds(compiled.metadata.shared, compiled.n_regs, compiled.metadata.num_warps,
                                          props.shared_memory_per_multiprocessor, props.regs_per_multiprocessor,
                                          props.max_threads_per_multi_processor)
    return max(1, min(wanted, _HELD[key]))


def plan(batch: int, q_heads: int, kv_heads: int, q_len: int, k_len: int, device: torch.device, *, block_n: int,
         programs_per_sm: int, pooled: float = 0.0, max_chunk_tiles: int | None = None) -> Plan:
    """At most ``programs_per_sm`` programs per SM in each wave (``programs_per_sm`` is one wave: what an SM holds
    at once), each chunk a whole number of ``block_n``-key tiles (the kernel's tile). Each kernel measures its own:
    resident programs hide each other's load latency, and a wave that fills only part of the SMs leaves the rest
    idle, so the programs come in whole waves: the chunks per (batch, KV head, row block) are as many as the waves'
    slots hold, rounded down. (Rounded up, the few programs past a wave each ran a whole chunk after it, on SMs
    otherwise idle: SFA decode at k = 16, D = 128, batch 8 ran 1088 programs in the 1056 slots of an H100, and its
    step took 0.961 ms against 0.851 now at 128K; Focus decode at 32K, batch 4, 0.0502 against 0.0457 ms. Batch 1
    plans are the same either way; benchmarks/results/decode_batch/NOTES.md.) With ``max_chunk_tiles``, a long
    cache gets as few whole waves as keep a chunk within ``max_chunk_tiles`` tiles: every wave pays each program's
    fixed start again (Focus decode's scan), so short caches run fastest in one wave and long ones in waves of
    bounded chunks. Where the batch's KV heads and row blocks alone outnumber a wave's slots, each gets one chunk.

    ``pooled`` in [0, 1): at least that fraction of the tiles is left out of the chunks, for a kernel whose
    programs take the rest over from a pool as they finish their chunk (0: the chunks cover every key)."""
    rows = q_heads // kv_heads * q_len
    block_m = min(_MAX_BLOCK_M, triton.next_power_of_2(max(1, rows)))
    row_blocks = triton.cdiv(rows, block_m)
    wave = programs_per_sm * sm_count(device)
    # Programs per chunk index; at least 1, so that an empty batch or query-head set plans one chunk of a grid with no
    # programs (a launch of nothing).
    chunk_programs = max(1, batch * kv_heads * row_blocks)
    tiles = triton.cdiv(k_len, block_n)
    waves = 1
    if max_chunk_tiles is not None:
        waves = triton.cdiv(triton.cdiv(tiles, max_chunk_tiles) * chunk_programs, wave)
    chunks = max(1, min(tiles, waves * wave // chunk_programs))
    if pooled > 0:
        return Plan(block_m, row_blocks, int(tiles * (1 - pooled)) // chunks * block_n, chunks)
    tiles_per_chunk = triton.cdiv(tiles, chunks)
    return Plan(block_m, row_blocks, tiles_per_chunk * block_n, triton.cdiv(tiles, tiles_per_chunk))


@jit
def program_rows(Q, stride_qb, stride_qh, stride_qt, stride_qd, kv_heads, group, q_len, k_len, chunk_keys,
                 BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's (batch, KV head, rows r [BLOCK_M] with row_ok, their positions q_pos, d = arange(D), the query
    rows q [BLOCK_M, D] (0 past the last row), pointers q_rows [BLOCK_M] to each row's first coordinate (rows past
    the last point anywhere: load them masked), and its key range [start, stop)). Row r is query r % Tq of query
    head r // Tq of the KV head's group; query i sits at key position Tk - Tq + i. A kernel that gathers q through
    q_rows leaves q unused, and the compiler drops its load."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // kv_heads).to(tl.int64)
    kv_head = (pid_bh % kv_heads).to(tl.int64)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < group * q_len
    i = r % q_len
    q_rows = Q + b * stride_qb + (kv_head * group + r // q_len) * stride_qh + i * stride_qt
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_rows[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    start = tl.program_id(1) * chunk_keys
    return b, kv_head, r, row_ok, k_len - q_len + i, d, q, q_rows, start, tl.minimum(start + chunk_keys, k_len)


@jit
def store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM: tl.constexpr):
    """Writes this program's rows to O [B, Hq, Tq, chunks, D] and LSE [B, Hq, Tq, chunks] (contiguous; with one
    chunk, the final tensors)."""
    row = (tl.program_id(0).to(tl.int64) * (group * q_len) + r) * num_chunks + tl.program_id(1)
    tl.store(LSE + row, lse, mask=row_ok)
    tl.store(O + row[:, None] * HEAD_DIM + d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


@jit
def _merge_kernel(O_PART, LSE_PART, O, LSE, num_chunks, HEAD_DIM: tl.constexpr, MERGE_CHUNKS: tl.constexpr,
                  MERGE_D: tl.constexpr):
    """Grid (rows, HEAD_DIM / MERGE_D). Merges coordinates [j * MERGE_D, (j + 1) * MERGE_D) of one row's chunks,
    j = program_id(1): O_PART [rows, chunks, D] and LSE_PART [rows, chunks] float32 into O [rows, D] and LSE [rows]
    float32 (written by the j = 0 program); a row whose chunks are all empty gets 0 and -inf. Launched as a
    programmatic dependent of the kernel that wrote the partials, where the GPU can.

    One pass, MERGE_CHUNKS chunks per step, the running maximum rescaling what came before (an online
    log-sum-exp): each step loads its log-sum-exps and outputs together, so a step's partials cost one memory round
    trip, where a first pass for the maximum cost a second one on the step's critical path."""
    wait_for_prior_kernel()
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * MERGE_D + tl.arange(0, MERGE_D)
    acc = tl.zeros([MERGE_D], tl.float32)
    total = tl.sum(tl.zeros([MERGE_CHUNKS], tl.float32), axis=0)  # of exp(lse - m_ref): >= 1 unless all are empty
    m_ref = total  # the reference maximum (0 while every chunk so far is empty)
    for c0 in range(0, num_chunks, MERGE_CHUNKS):
        c = c0 + tl.arange(0, MERGE_CHUNKS)
        ok = c < num_chunks
        lse_c = tl.load(LSE_PART + row * num_chunks + c, mask=ok, other=float("-inf"))
        o = tl.load(O_PART + (row * num_chunks + c[:, None]) * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        m = tl.max(lse_c, axis=0)
        # Empty so far (total 0): the new maximum, or 0 if this step is empty too; else the larger maximum.
        m_new = tl.where(total > 0, tl.maximum(m_ref, m), tl.where(m == float("-inf"), 0.0, m))
        # <= 1; while every chunk so far is empty, 1 (acc and total are 0), not exp(0 - m_new), which may overflow.
        rescale = tl.exp(tl.where(total > 0, m_ref, m_new) - m_new)
        w = tl.exp(lse_c - m_new)
        total = total * rescale + tl.sum(w, axis=0)
        acc = acc * rescale + tl.sum(w[:, None] * o, axis=0)
        m_ref = m_new
    if tl.program_id(1) == 0:
        tl.store(LSE + row, tl.where(total > 0, m_ref + tl.log(tl.maximum(total, 1.0)), float("-inf")))
    tl.store(O + row * HEAD_DIM + d, (acc / tl.maximum(total, 1.0)).to(O.dtype.element_ty))


def partials(q: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partial buffers [B, Hq, Tq, chunks, D] and [B, Hq, Tq, chunks] for q [B, Hq, Tq, D]."""
    return (torch.empty(*q.shape[:3], chunks, q.shape[3], dtype=torch.float32, device=q.device),
            torch.empty(*q.shape[:3], chunks, dtype=torch.float32, device=q.device))


def merge(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merges the partials of :func:`partials` into out [B, Hq, Tq, D] and lse [B, Hq, Tq] (contiguous)."""
    chunks, head_dim = part_out.shape[-2], part_out.shape[-1]
    merge_d = min(head_dim, _MERGE_D)
    _merge_kernel[(lse.numel(), head_dim // merge_d)](part_out, part_lse, out, lse, chunks, HEAD_DIM=head_dim,
                                                      MERGE_CHUNKS=_MERGE_CHUNKS, MERGE_D=merge_d,
                                                      launch_pdl=hopper_or_newer(lse.device))
