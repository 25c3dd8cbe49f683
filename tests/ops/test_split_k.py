"""split_k.plan: how a decode step's keys are cut into chunks, for both decode kernels' settings, batch 1 to 8; and
split_k.merge, the merge of the chunks' partials (Triton; the interpreter without CUDA, tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops import split_k
from sieve_attn.ops.focus import decode as focus_decode
from sieve_attn.ops.sfa import decode as sfa_decode
from sieve_attn.ops.triton_common import kernel_blocker

SMS = 132  # the CPU plans for an H200 (split_k._DEFAULT_SMS), as does an H100 SXM
KERNELS = {
    "focus": dict(block_n=focus_decode._block_n(128), programs_per_sm=focus_decode._PROGRAMS_PER_SM,
                  max_chunk_tiles=focus_decode._MAX_CHUNK_TILES),
    "sfa": dict(block_n=sfa_decode._BLOCK_N, programs_per_sm=sfa_decode._programs_per_sm(128)),
    "sfa-pooled": dict(block_n=sfa_decode._BLOCK_N, programs_per_sm=sfa_decode._programs_per_sm(128),
                       pooled=sfa_decode._pool_fraction(8)),
    "sfa-pooled-topk16": dict(block_n=sfa_decode._BLOCK_N, programs_per_sm=sfa_decode._programs_per_sm(128),
                              pooled=sfa_decode._pool_fraction(16)),
}


def fewest_waves(tiles: int, chunk_programs: int, wave: int, max_chunk_tiles) -> int:
    """The fewest waves of ``wave`` programs in which chunks of at most ``max_chunk_tiles`` tiles cover ``tiles``."""
    if max_chunk_tiles is None:
        return 1
    waves = 1
    while (waves * wave // chunk_programs) * max_chunk_tiles < tiles:
        waves += 1
    return waves


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k_len", [100, 8192, 32768 + 5, 131072, 1 << 20])
def test_programs_fill_whole_waves_and_chunks_cover_the_keys(kernel, batch, k_len):
    """GQA 32/8, one query: the chunks are whole tiles that cover the keys (the pooled plan leaves at least its
    fraction past them), within the kernel's bound; the programs never spill past the fewest whole waves the bound
    allows (a program past a wave runs a whole chunk while most SMs idle: SFA at batch 8 ran 1088 programs in 1056
    slots before), and fill the last of them but for the rounding to whole tiles."""
    settings = KERNELS[kernel]
    block_n, max_tiles, pooled = settings["block_n"], settings.get("max_chunk_tiles"), settings.get("pooled", 0.0)
    work = split_k.plan(batch, 32, 8, 1, k_len, torch.device("cpu"), **settings)
    tiles = -(-k_len // block_n)
    chunk_programs = batch * 8 * work.row_blocks
    wave = settings["programs_per_sm"] * SMS
    waves = fewest_waves(tiles, chunk_programs, wave, max_tiles)
    programs = chunk_programs * work.chunks
    assert work.chunk_keys % block_n == 0 and work.chunks >= 1
    if pooled:
        assert tiles - work.chunks * work.chunk_keys // block_n >= pooled * tiles
    else:
        assert work.chunks * work.chunk_keys >= k_len > (work.chunks - 1) * work.chunk_keys
    if max_tiles is not None:
        assert work.chunk_keys <= max_tiles * block_n
    assert programs <= waves * wave, (programs, waves, wave)
    if work.chunks < tiles:  # enough keys to fill the waves
        assert programs > waves * wave * 0.85, (programs, waves, wave)


def test_more_kv_heads_than_a_wave_holds_get_one_chunk_each():
    work = split_k.plan(64, 64, 64, 1, 8192, torch.device("cpu"), block_n=32, programs_per_sm=8)
    assert work.chunks == 1 and work.chunk_keys >= 8192


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch, q_heads", [(0, 32), (1, 0)], ids=["no-batch", "no-query-heads"])
def test_an_empty_step_plans_no_programs(kernel, batch, q_heads):
    work = split_k.plan(batch, q_heads, 8, 1, 131072, torch.device("cpu"), **KERNELS[kernel])
    assert batch * 8 * work.row_blocks == 0 and work.chunks >= 1


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32 = torch.float32
MERGE_BLOCKER = kernel_blocker(torch.empty(64, device=DEVICE))


def merge_reference(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge in part_out's dtype: out = sum_c softmax(lse)_c * o_c, lse = logsumexp_c lse_c; rows whose chunks
    are all empty: 0 and -inf."""
    lse = torch.logsumexp(part_lse, dim=-1)
    weights = torch.exp(part_lse - torch.where(lse.isinf(), 0, lse)[..., None])
    return (weights[..., None] * part_out).sum(-2), lse


def merge_partials(chunks: int, first_empty: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partials [1, 6, 1, chunks, 64] and [1, 6, 1, chunks] of six rows: all chunks empty (log-sum-exp -inf,
    output 0, as the decode kernels leave them); the first ``first_empty`` chunks empty, then spread values; around
    -300 (exp overflows float32 unless taken relative to the maximum); around +80; one finite chunk, the last;
    spread values everywhere."""
    generator = torch.Generator().manual_seed(chunks)
    lse = torch.randn(6, chunks, generator=generator) * 3
    lse[0] = float("-inf")
    lse[1, :first_empty] = float("-inf")
    lse[2] -= 300
    lse[3] += 80
    lse[4, :-1] = float("-inf")
    out = torch.randn(6, chunks, 64, generator=generator)
    out[lse.isinf()] = 0
    return out.view(1, 6, 1, chunks, 64).to(DEVICE), lse.view(1, 6, 1, chunks).to(DEVICE)


@pytest.mark.skipif(MERGE_BLOCKER is not None, reason=str(MERGE_BLOCKER))
@pytest.mark.parametrize("chunks, merge_chunks", [(1, 256), (133, 256), (133, 16), (7, 2)],
                         ids=["one-chunk", "one-step", "nine-steps", "four-steps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_matches_float64_with_empty_and_extreme_chunks(chunks, merge_chunks, dtype, monkeypatch):
    """merge over any number of steps of MERGE_CHUNKS chunks (the first of them empty for one row) equals the float64
    merge within twice the error of the same float32 formula in PyTorch plus the output's one rounding to its dtype
    (an ulp); an all-empty row gives 0 and -inf, never NaN; every output element is written (the outputs start
    NaN-poisoned)."""
    monkeypatch.setattr(split_k, "_MERGE_CHUNKS", merge_chunks)
    part_out, part_lse = merge_partials(chunks, first_empty=min(merge_chunks, chunks - 1))
    out = torch.empty(1, 6, 1, 64, dtype=dtype, device=DEVICE)
    lse = torch.empty(1, 6, 1, dtype=torch.float32, device=DEVICE)
    split_k.merge(part_out, part_lse, out, lse)
    exact_out, exact_lse = merge_reference(part_out.double(), part_lse.double())
    torch_out, torch_lse = merge_reference(part_out, part_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[0, 0] == 0).all() and lse[0, 0].item() == float("-inf")
    finite = exact_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    for got, exact, float32, ulp in ((out, exact_out, torch_out, torch.finfo(dtype).eps),
                                     (lse[finite], exact_lse[finite], torch_lse[finite], torch.finfo(F32).eps)):
        bound = 2 * (float32.double() - exact).abs().max().item() + ulp * exact.abs() + 1e-6
        assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max().item()


@pytest.mark.parametrize("shared, registers, warps, held", [
    (27920, 166, 1, 8),  # SFA decode, D = 128, topk = 16, sm_90 (Triton 3.6): 8 x (27920 + 1024) <= 233472
    (30736, 168, 1, 7),  # topk = 20: one program fewer than the 8 its plan wanted
    (33552, 168, 1, 6),  # topk = 24
    (1000, 255, 1, 8),  # registers: 255 a thread round up to 8192 a warp
    (1000, 32, 8, 8),  # threads: 2048 / 256
    (232449, 32, 1, 0),  # one program does not fit
])
def test_programs_an_sm_holds_counts_shared_memory_with_its_reserve_registers_and_threads(shared, registers, warps,
                                                                                           held):
    """An H100's or H200's SM: 233472 bytes of shared memory (the driver's 1 KiB per block inside it), 65536
    registers, 2048 threads."""
    assert split_k.programs_an_sm_holds(shared, registers, warps, 233472, 65536, 2048) == held


def test_programs_per_sm_off_cuda_is_what_the_plan_wanted():
    """Without a GPU nothing is compiled to count: the wanted number stands (the interpreter's plans follow an
    H200's)."""
    assert split_k.programs_per_sm(split_k._merge_kernel, (), {}, torch.device("cpu"), 5) == 5
