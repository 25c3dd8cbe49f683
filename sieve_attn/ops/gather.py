"""Gathering the rows of every head into a new layout: the sorted-group packing of the decomposition backend.

A tensor [A, H, I, D] holds, for each head, A x I rows of D features; row r is (r // I, r % I). ``gather_rows``
builds a contiguous [A', H, I', D] whose row n (of every head) is the source's row ``index[n]``, or zeros where
``index[n]`` is -1. In PyTorch this is advanced indexing over two dimensions around the heads, whose CUDA kernel
moved those bytes at a fraction of the memory bandwidth (H200, 64K tokens x 8 heads x 128 features, bf16: 0.4-0.5 ms
per tensor, where the bytes alone take 0.07 ms), so on CUDA a Triton kernel copies each row once, 16 bytes at a time.
"""
from __future__ import annotations

from typing import Optional

import torch

from .triton_common import jit, on_device_of, triton

if triton is not None:
    import triton.language as tl

# Rows per program; each program copies them for one head.
_ROWS = 64


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor, outer: int, inner: int, factor: float = 1.0,
                          dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`gather_rows` in plain PyTorch."""
    heads = src.shape[1]
    flat = src.transpose(1, 2).reshape(-1, heads, src.shape[3])  # [A * I, H, D], row-major over (a, i)
    rows = torch.where((index >= 0)[:, None, None], flat[index.clamp_min(0)], 0.0)
    if factor != 1.0 or (dtype or src.dtype) != src.dtype:
        rows = (rows.to(torch.promote_types(src.dtype, torch.float32)) * factor).to(dtype or src.dtype)
    return rows.view(outer, inner, heads, -1).transpose(1, 2).contiguous()


def gather_rows(src: torch.Tensor, index: torch.Tensor, outer: int, inner: int, factor: float = 1.0,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """src [A, H, I, D] (any strides); index [N] int (N = outer x inner) of source rows
    r = a x I + i, or -1. Returns a new contiguous [outer, H, inner, D] tensor of ``dtype`` (default src's): row
    n = (n // inner, n % inner) of each head is the source's row index[n] of that head times ``factor`` (in float32,
    float64 for float64 sources, rounded once to ``dtype``), zeros for -1: the float16 copies of the decomposition's
    inclusion-exclusion calls are packed in the same pass. The kernel serves CUDA tensors that autograd does not
    track (the decomposition's forward and backward, which handle gradients themselves); the rest, flex's
    differentiable packing included, takes the PyTorch reference."""
    if index.numel() != outer * inner:
        raise ValueError(f"index: expected {outer} x {inner} = {outer * inner} rows, got {index.numel()}")
    tracked = torch.is_grad_enabled() and src.requires_grad
    if triton is None or src.device.type != "cuda" or tracked or (src.dtype == torch.float64 and factor != 1.0):
        return gather_rows_reference(src, index, outer, inner, factor, dtype)
    return gather_rows_triton(src, index, outer, inner, factor, dtype)


def gather_rows_triton(src, index, outer, inner, factor=1.0, dtype=None):
    """:func:`gather_rows` by the Triton kernel (CUDA, or the interpreter)."""
    heads, dim = src.shape[1], src.shape[3]
    out = src.new_empty(outer, heads, inner, dim, dtype=dtype)
    count = outer * inner
    with on_device_of(src):
        _gather_rows_kernel[(triton.cdiv(count, _ROWS), heads)](
            src, index.contiguous(), out, count, src.shape[2], inner, *src.stride(), dim, float(factor),
            SCALED=factor != 1.0, ROWS=_ROWS, BLOCK_D=triton.next_power_of_2(dim))
    return out


@jit
def _gather_rows_kernel(SRC, INDEX, OUT, count, src_inner, out_inner, s_a, s_h, s_i, s_d, dim, factor,
                        SCALED: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    head = tl.program_id(1).to(tl.int64)  # head x head stride passes 2**31 in large tensors
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = n < count
    row = tl.load(INDEX + n, mask=live, other=-1).to(tl.int64)
    real = row >= 0
    safe = tl.maximum(row, 0)
    features = tl.arange(0, BLOCK_D)
    inside = features < dim
    source = SRC + (safe // src_inner) * s_a + head * s_h + (safe % src_inner) * s_i
    values = tl.load(source[:, None] + features[None, :] * s_d, mask=real[:, None] & inside[None, :], other=0.0)
    if SCALED:
        values = values.to(tl.float32) * factor
    n64 = n.to(tl.int64)
    heads = tl.num_programs(1)
    target = OUT + ((n64 // out_inner) * heads + head) * out_inner * dim + (n64 % out_inner) * dim
    tl.store(target[:, None] + features[None, :], values.to(OUT.dtype.element_ty), mask=live[:, None] & inside[None, :])
