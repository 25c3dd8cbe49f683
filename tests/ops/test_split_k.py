"""split_k.plan: how a decode step's keys are cut into chunks, for both decode kernels' settings, batch 1 to 8."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops import split_k
from sieve_attn.ops.focus import decode as focus_decode
from sieve_attn.ops.sfa import decode as sfa_decode

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
