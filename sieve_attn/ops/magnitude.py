"""The largest magnitude of each of a few tensors: what the decomposition's float16 copies are scaled by.

PyTorch's reduction (``torch.linalg.vector_norm(x, inf)``) read bf16 q, k and v [1, 8, 64K, 128] in 0.15-0.18 ms on
the H200 (2.2-2.6 TB/s); on CUDA a Triton kernel reads each tensor once with about a thousand programs, each folding
its rows of one head into one atomic maximum: 0.10-0.11 ms at 64K tokens (3.5 TB/s), 0.375 ms at 256K against 0.478
(v19 in benchmarks/results/focus_h200/NOTES.md).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .triton_common import jit, on_device_of, triton

if triton is not None:
    import triton.language as tl

# Rows of D features per step of a program, the programs of one launch (spread over the B x H heads; each ends in
# one atomic) and their warps: the v19 probe's plan (32-128 rows, 512-4096 programs, 4 or 8 warps; the best five
# within 2% of one another at 64K and 256K).
_ROWS = 64
_PROGRAMS = 1024
_NUM_WARPS = 4


def largest_magnitudes_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`largest_magnitudes` in plain PyTorch."""
    return torch.stack([torch.linalg.vector_norm(t, float("inf")).float() if t.numel() else
                        torch.zeros((), device=t.device) for t in tensors])


def largest_magnitudes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [n]: max |x| over all elements of each of n tensors [B, H, T, D] (any strides, one device), 0 for an
    empty tensor, NaN where a tensor holds NaN. One read of each tensor; no host synchronisation."""
    if triton is None or tensors[0].device.type != "cuda" or any(t.dtype == torch.float64 for t in tensors):
        return largest_magnitudes_reference(tensors)
    return largest_magnitudes_triton(tensors)


def largest_magnitudes_triton(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`largest_magnitudes` by the Triton kernel (CUDA, or the interpreter)."""
    # The maxima accumulate as the int32 bit patterns of non-negative float32 values, whose integer order is their
    # numeric order (NaN, with its sign bit cleared, above infinity), so an integer atomic maximum serves.
    bits = torch.zeros(len(tensors), dtype=torch.int32, device=tensors[0].device)
    with on_device_of(tensors[0]):
        for j, x in enumerate(tensors):
            batch, heads, length, dim = x.shape
            if x.numel() == 0:
                continue
            per_head = max(1, min(triton.cdiv(length, _ROWS), _PROGRAMS // (batch * heads)))
            _largest_kernel[(batch * heads, per_head)](x, bits[j:], heads, length, dim, *x.stride(), ROWS=_ROWS,
                                                       BLOCK_D=triton.next_power_of_2(dim), num_warps=_NUM_WARPS)
    return bits.view(torch.float32)


@jit
def _largest_kernel(X, BITS, heads, length, dim, s_b, s_h, s_t, s_d, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B * H, P): program (b * H + h, p) folds the row blocks p, p + P, p + 2P, ... (ROWS positions t of D
    features each) of head h of sequence b into one maximum of the bit patterns of |x|, then one atomic maximum into
    BITS[0]."""
    sequence_head = tl.program_id(0)
    head = X + (sequence_head // heads).to(tl.int64) * s_b + (sequence_head % heads).to(tl.int64) * s_h
    features = tl.arange(0, BLOCK_D)
    offsets = features.to(tl.int64)[None, :] * s_d  # a permuted view's feature stride may pass 2**31 / D
    inside = (features < dim)[None, :]
    largest = tl.zeros([ROWS, BLOCK_D], tl.int32)
    for first in range(tl.program_id(1) * ROWS, length, tl.num_programs(1) * ROWS):
        t = first + tl.arange(0, ROWS)
        x = tl.load(head + t.to(tl.int64)[:, None] * s_t + offsets, mask=(t < length)[:, None] & inside, other=0.0)
        # |x| as the bit pattern with the sign bit cleared: NaN stays above infinity whatever abs() makes of NaN
        largest = tl.maximum(largest, x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.atomic_max(BITS, tl.max(tl.max(largest, axis=1), axis=0))
