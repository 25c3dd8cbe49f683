"""gather_rows: the Triton kernel (the interpreter on the CPU) against its PyTorch reference, and the reference
against plain indexing."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops import gather

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _source(a, heads, inner, dim, dtype, strided):
    """[a, heads, inner, dim]; strided: token-major memory, or (strided="features") features not contiguous."""
    gen = torch.Generator().manual_seed(a * 100 + inner)
    if strided == "features":
        return torch.randn(a, heads, dim, inner, generator=gen).to(DEVICE, dtype).transpose(2, 3)
    x = torch.randn(a, inner, heads, dim, generator=gen).to(DEVICE, dtype)
    return x.transpose(1, 2) if strided else x.transpose(1, 2).contiguous()


def _index(count, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (count,), generator=gen)
    index[::5] = -1
    return index.to(DEVICE)


def test_reference_is_plain_indexing_with_zero_rows():
    src = _source(2, 3, 7, 5, torch.float32, strided=False)
    index = _index(12, 14, seed=1)
    got = gather.gather_rows_reference(src, index, 3, 4)
    for n in range(12):
        want = src[index[n] // 7, :, index[n] % 7] if index[n] >= 0 else torch.zeros(3, 5, device=DEVICE)
        assert torch.equal(got[n // 4, :, n % 4], want)


@pytest.mark.parametrize("a, heads, inner, dim, dtype, strided, outer, out_inner", [
    (1, 2, 70, 16, torch.bfloat16, False, 5, 16),     # packing: 5 segments of 16 slots
    (2, 3, 33, 24, torch.float32, True, 66, 1),       # rows of memberships, D not a power of two, token-major source
    (3, 1, 9, 128, torch.float16, False, 3, 9),       # unpacking into token order
    (1, 4, 300, 64, torch.bfloat16, True, 2, 150),    # several programs per head
    (2, 3, 40, 1, torch.float32, False, 4, 20),       # log-sum-exp rows: one feature
    (1, 2, 45, 32, torch.float32, "features", 3, 15),  # a transposed view: features 45 elements apart
])
def test_kernel_matches_reference(a, heads, inner, dim, dtype, strided, outer, out_inner):
    pytest.importorskip("triton")
    src = _source(a, heads, inner, dim, dtype, strided)
    index = _index(outer * out_inner, a * inner, seed=outer)
    got = gather.gather_rows_triton(src, index, outer, out_inner)
    assert got.is_contiguous() and got.shape == (outer, heads, out_inner, dim)
    assert torch.equal(got, gather.gather_rows_reference(src, index, outer, out_inner))


def test_refuses_an_index_of_the_wrong_length():
    src = _source(1, 2, 8, 16, torch.float32, strided=False)
    with pytest.raises(ValueError, match="index: expected 3 x 4 = 12 rows, got 11"):
        gather.gather_rows(src, torch.zeros(11, dtype=torch.long, device=DEVICE), 3, 4)


@pytest.mark.parametrize("variant", ["reference", "triton"])
def test_scaled_rows_cast_once(variant):
    """A power-of-two factor and a float16 result: bf16 rows times 2^9 land exactly in float16, zeros stay zeros."""
    if variant == "triton":
        pytest.importorskip("triton")
    src = _source(2, 3, 21, 24, torch.bfloat16, strided=True)
    index = _index(30, 42, seed=4)
    run = gather.gather_rows_triton if variant == "triton" else gather.gather_rows_reference
    got = run(src, index, 5, 6, 2.0 ** 9, torch.float16)
    assert got.dtype == torch.float16 and got.is_contiguous()
    plain = gather.gather_rows_reference(src, index, 5, 6)
    assert torch.equal(got.double(), plain.double() * 2.0 ** 9)
