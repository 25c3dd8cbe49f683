"""largest_magnitudes: the Triton kernel (the interpreter on the CPU) against its PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops import magnitude

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, 3, 45, 24, generator=gen) * 7).to(DEVICE, torch.bfloat16),   # D not a power of two
        torch.randn(2, 1, 64, 45, generator=gen).to(DEVICE).transpose(2, 3),          # features strided
        -torch.rand(1, 2, 3, 16, generator=gen).to(DEVICE, torch.float16) * 1e4,     # the largest is negative
        torch.zeros(1, 4, 700, 8, device=DEVICE),                                     # several steps per program
    ]


def test_kernel_matches_reference():
    pytest.importorskip("triton")
    tensors = _tensors(0)
    got = magnitude.largest_magnitudes_triton(tensors)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert torch.equal(got, magnitude.largest_magnitudes_reference(tensors))


def test_kernel_passes_nan_and_infinity_on():
    pytest.importorskip("triton")
    tensors = _tensors(1)
    tensors[0][1, 2, 44, 23] = float("-inf")
    tensors[1][0, 0, 3, 5] = float("nan")
    got = magnitude.largest_magnitudes_triton(tensors)
    assert got[0] == float("inf") and got[1].isnan() and torch.equal(got[2:], magnitude.largest_magnitudes(
        tensors[2:]))


def test_empty_tensors_have_largest_magnitude_zero():
    tensors = [torch.zeros(1, 2, 0, 16, device=DEVICE), torch.ones(1, 1, 2, 16, device=DEVICE)]
    assert magnitude.largest_magnitudes(tensors).tolist() == [0.0, 1.0]
    if DEVICE == "cpu":
        pytest.importorskip("triton")
        assert magnitude.largest_magnitudes_triton(tensors).tolist() == [0.0, 1.0]


def test_kernel_passes_a_negative_nan_on():
    """A NaN whose sign bit is set (what -nan and some kernels write) still reads as NaN."""
    pytest.importorskip("triton")
    x = torch.zeros(1, 1, 4, 16, device=DEVICE)
    x[0, 0, 1, 3] = -float("nan")
    assert torch.signbit(x[0, 0, 1, 3]) and magnitude.largest_magnitudes_triton([x])[0].isnan()
