"""SFAKeyCache (compressed keys with bit-packed indices, dense V) and sfa_decode against the SFA reference on the
dense keys.

Without CUDA the Triton kernel runs in Triton's interpreter, chosen when sieve_attn.ops.sfa.decode is first
imported: tests/conftest.py sets TRITON_INTERPRET for the session, and this module again (setdefault) so that it does
not depend on that file. If the module was imported without it anyway, the kernel cases skip.
"""
from __future__ import annotations

import os
from functools import partial

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sieve_attn.ops.sfa.decode as decode_module  # noqa: E402
from sieve_attn.ops.sfa.cache import (SFAKeyCache, dense_bytes_per_token, index_bits, pack_indices,  # noqa: E402
                                      packed_bytes, unpack_indices)
from sieve_attn.ops import split_k  # noqa: E402
from sieve_attn.ops.sfa.codes import densify, index_dtype, sparse_codes, sparsify  # noqa: E402
from sieve_attn.ops.sfa.decode import (sfa_decode, sfa_decode_reference, sfa_decode_triton,  # noqa: E402
                                       sparse_query_table)
from sieve_attn.ops.sfa.pool import pool_unit, pool_units, unit_levels  # noqa: E402
from sieve_attn.ops.sfa.reference import sfa_attention_reference  # noqa: E402
from sieve_attn.ops.triton_common import kernel_blocker, triton  # noqa: E402

if triton is not None:
    import triton.language as tl

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
KERNEL_BLOCKER = kernel_blocker(torch.empty(1, 1, 1, 32, device=DEVICE))


def measured_dense_bytes_per_token(batch, kv_heads, capacity, head_dim, dtype):
    """Bytes per token slot and KV head of a dense K+V cache, measured from two allocated tensors."""
    k, v = (torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    return (k.untyped_storage().nbytes() + v.untyped_storage().nbytes()) / (batch * kv_heads * capacity)


# ----------------------------------------------------------------------------------------------------------------
# Bit packing of the indices
# ----------------------------------------------------------------------------------------------------------------

def bit_string_pack(indices, bits):
    """pack_indices' layout spelled out bit by bit: index j's bit i is bit j * bits + i of the key's bit string,
    whose bit p is bit p % 8 of byte p // 8; the tail of the last byte is 0."""
    topk = indices.shape[-1]
    string = (indices.long()[..., None] >> torch.arange(bits, device=indices.device)) & 1  # [..., topk, bits]
    string = string.reshape(*indices.shape[:-1], topk * bits)
    nbytes = -(-topk * bits // 8)
    string = torch.nn.functional.pad(string, (0, nbytes * 8 - topk * bits))
    weights = 1 << torch.arange(8, device=indices.device)
    return (string.reshape(*indices.shape[:-1], nbytes, 8) * weights).sum(-1).to(torch.uint8)


def test_index_bits_and_packed_bytes():
    assert [index_bits(d) for d in (1, 2, 3, 4, 5, 7, 64, 100, 128, 129, 256, 257, 1000, 2 ** 16 + 1)] == \
        [1, 1, 2, 2, 3, 3, 6, 7, 7, 8, 8, 9, 10, 17]
    assert packed_bytes(16, 128) == 14 and packed_bytes(8, 64) == 6 and packed_bytes(7, 100) == 7
    assert packed_bytes(1, 1) == 1 and packed_bytes(3, 1000) == 4


def test_packed_layout_by_hand():
    """D = 128 (7 bits): index 0 in bits 0-6, index 1 in bits 7-13; 1 + (2 << 7) = 257 = bytes [1, 1]. D = 1000
    (10 bits): 999 and 1 -> 999 + (1 << 10) = 2023 = bytes [231, 7, 0], the last byte's tail 0."""
    assert pack_indices(torch.tensor([1, 2]), 128).tolist() == [1, 1]
    assert pack_indices(torch.tensor([127, 0]), 128).tolist() == [127, 0]
    assert pack_indices(torch.tensor([0, 127]), 128).tolist() == [128, 63]
    assert pack_indices(torch.tensor([999, 1]), 1000).tolist() == [231, 7, 0]


@pytest.mark.parametrize("head_dim", [1, 2, 3, 7, 64, 100, 128, 256, 257, 1000])
def test_pack_unpack_round_trip(head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    for topk in sorted({1, 2, 3, 5, 7, 8, 9, 16, 17, 33} & set(range(1, head_dim + 1)) | {head_dim}):
        # Random keys of distinct coordinates, as a cache holds, then a key of all zeros and one of all D - 1 (every
        # bit set: a carry into a neighbour's bits would show).
        indices = torch.rand(4, 3, 11, head_dim, generator=generator).argsort(-1)[..., :topk]
        indices[0, 0, 0], indices[0, 0, 1] = 0, head_dim - 1
        indices = indices.to(index_dtype(head_dim))
        packed = pack_indices(indices, head_dim)
        assert packed.dtype == torch.uint8 and packed.shape == (4, 3, 11, packed_bytes(topk, head_dim))
        assert torch.equal(packed, bit_string_pack(indices, index_bits(head_dim)))
        unpacked = unpack_indices(packed, head_dim, topk)
        assert unpacked.dtype == torch.int64 and torch.equal(unpacked, indices.long())


# ----------------------------------------------------------------------------------------------------------------
# Bytes
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim, topk, dtype, index_bytes", [(128, 16, BF16, 14), (64, 8, F16, 6),
                                                                 (100, 7, BF16, 7), (512, 16, F32, 18)])
def test_bytes_per_token_are_measured_from_the_allocation(head_dim, topk, dtype, index_bytes):
    cache = SFAKeyCache(2, 8, head_dim, topk=topk, dtype=dtype, device=DEVICE, capacity=1024)
    assert cache.packed_bytes == index_bytes == packed_bytes(topk, head_dim)
    element = dtype.itemsize
    expected = index_bytes + topk * element + head_dim * element  # packed indices + key values + dense V
    assert cache.bytes_per_token() == expected
    assert cache.allocated_bytes() == expected * 2 * 8 * 1024
    dense = measured_dense_bytes_per_token(2, 8, 1024, head_dim, dtype)
    assert dense == dense_bytes_per_token(head_dim, dtype) == 2 * head_dim * element


def test_bytes_per_token_count_each_heads_padding_of_its_packed_indices():
    """Each head's packed indices fill whole 4-byte words (the decode kernel reads words): one token of D = 16,
    topk = 4 packs its indices in 2 bytes and takes 4, so 4 + 4 * 4 + 16 * 4 = 84 bytes in float32 (the formula
    without the padding: 82)."""
    cache = SFAKeyCache(1, 1, 16, topk=4, dtype=F32, device=DEVICE, capacity=1)
    assert cache.packed_bytes == 2 and cache.bytes_per_token() == 84


def test_kv_cache_is_at_most_59_percent_of_dense_at_d128_k16_bf16():
    """The issue's setting (D = 128, topk = 16, bfloat16 values): 16 indices of 7 bits in 14 bytes, so
    (14 + 32 + 256) / 512 = 0.58984375 <= 0.59, i.e. 41.0% less than dense K+V (whole bytes per index, 304 bytes,
    would miss it at 0.59375)."""
    cache = SFAKeyCache(1, 8, 128, topk=16, dtype=BF16, device=DEVICE, capacity=4096)
    assert (cache.index_bits, cache.packed_bytes) == (7, 14)
    storages = [t.untyped_storage().nbytes() for t in (cache._packed, cache._values, cache._v)]
    assert storages == [8 * 4096 * 14, 8 * 4096 * 16 * 2, 8 * 4096 * 128 * 2]
    dense = measured_dense_bytes_per_token(1, 8, 4096, 128, BF16)
    assert sum(storages) / (8 * 4096) == cache.bytes_per_token() == 302 and dense == 512
    assert cache.bytes_per_token() / dense == 302 / 512 <= 0.59


# ----------------------------------------------------------------------------------------------------------------
# Appends and growth
# ----------------------------------------------------------------------------------------------------------------

def random_kv(batch, kv_heads, length, head_dim, dtype):
    return (torch.randn(batch, kv_heads, length, head_dim, device=DEVICE).to(dtype) for _ in range(2))


def test_token_by_token_equals_all_at_once_and_growth_keeps_contents():
    torch.manual_seed(0)
    k, v = random_kv(2, 3, 37, 32, BF16)
    at_once = SFAKeyCache(2, 3, 32, topk=5, dtype=BF16, device=DEVICE, capacity=64)
    at_once.append(k, v)
    one_by_one = SFAKeyCache(2, 3, 32, topk=5, dtype=BF16, device=DEVICE, capacity=1)
    for t in range(37):
        one_by_one.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert one_by_one.capacity == max(1, 1 << t.bit_length())  # doubled only when full
    assert len(one_by_one) == len(at_once) == 37 and one_by_one.capacity == at_once.capacity == 64
    assert one_by_one.allocated_bytes() == at_once.allocated_bytes()
    indices, values = sparse_codes(k, 5)
    for cache in (one_by_one, at_once):
        assert all(torch.equal(got, want) for got, want in zip(cache.keys(), (indices, values)))
        assert torch.equal(cache.values(), v)
        assert cache.keys()[0].dtype == torch.uint8 and cache.keys()[1].dtype == BF16
        for start, stop in ((0, 37), (5, 6), (36, 37), (10, 10)):
            assert torch.equal(cache.keys(start, stop)[0], indices[:, :, start:stop])
            assert torch.equal(cache.keys(start, stop)[1], values[:, :, start:stop])


@pytest.mark.parametrize("head_dim, topk", [(257, 3), (1000, 17)])
def test_keys_unpack_to_the_index_dtype_above_256(head_dim, topk):
    torch.manual_seed(0)
    k, v = random_kv(1, 2, 9, head_dim, F32)
    cache = SFAKeyCache(1, 2, head_dim, topk=topk, dtype=F32, device=DEVICE, capacity=4)
    cache.append(k, v)
    indices, values = cache.keys()
    assert indices.dtype == torch.int16 and cache._packed.shape[-1] == packed_bytes(topk, head_dim)
    assert all(torch.equal(got, want) for got, want in zip((indices, values), sparse_codes(k, topk)))


def test_append_codes_equals_append():
    torch.manual_seed(0)
    k, v = random_kv(1, 2, 9, 64, F16)
    coded = SFAKeyCache(1, 2, 64, topk=7, dtype=F16, device=DEVICE, capacity=4)
    coded.append_codes(*sparse_codes(k[:, :, :4], 7), v[:, :, :4])
    coded.append_codes(*sparse_codes(k[:, :, 4:], 7), v[:, :, 4:])
    dense = SFAKeyCache(1, 2, 64, topk=7, dtype=F16, device=DEVICE, capacity=4)
    dense.append(k, v)
    assert all(torch.equal(a, b) for a, b in zip(coded.keys(), dense.keys()))
    assert torch.equal(coded.values(), dense.values())


# ----------------------------------------------------------------------------------------------------------------
# Decode against the reference
# ----------------------------------------------------------------------------------------------------------------

# (batch, q_heads, kv_heads, q_len, k_len, head_dim, topk, dtype)
CASES = {
    "mha-one-key": (1, 2, 2, 1, 1, 32, 4, F32),
    "mha-63-k1": (2, 2, 2, 3, 63, 32, 1, BF16),
    "mha-257-k1-f32": (1, 2, 2, 3, 257, 64, 1, F32),
    "gqa-one-key-kD": (1, 4, 1, 1, 1, 64, 64, BF16),
    "gqa-257-k4": (1, 4, 2, 3, 257, 64, 4, BF16),
    "gqa-257-kD-f32": (1, 4, 2, 1, 257, 64, 64, F32),
    "gqa-257-d128-k16": (1, 4, 2, 2, 257, 128, 16, BF16),
    "gqa-129-d64-k8": (2, 8, 2, 2, 129, 64, 8, BF16),
    "gqa-99-d64-k6-int32-words": (1, 4, 2, 1, 99, 64, 6, BF16),
    "mqa-77-d128-k7-f16": (1, 4, 1, 1, 77, 128, 7, F16),
    "gqa-65-d16-k3-f32": (1, 6, 3, 2, 65, 16, 3, F32),
    "mha-200-d256-k17": (1, 2, 2, 1, 200, 256, 17, BF16),
    "mqa-257-kD": (2, 3, 1, 1, 257, 32, 32, BF16),
    "mqa-63-k4-f16": (1, 3, 1, 3, 63, 64, 4, F16),
    "mqa-two-row-blocks": (1, 32, 1, 3, 63, 32, 4, F32),
}


def filled_cache(k, v, topk):
    """A cache of k and v [B, Hkv, T, D], filled by a prefill of about half the tokens and then one token at a
    time (so it grows), with NaN in the key values and V of its unused capacity and all-ones bytes in its packed
    indices: reading past the cached length would show in the output."""
    batch, kv_heads, length, head_dim = k.shape
    cache = SFAKeyCache(batch, kv_heads, head_dim, topk=topk, dtype=k.dtype, device=k.device, capacity=8)
    prefill = (length + 1) // 2
    cache.append(k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, length):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    cache._packed[:, :, length:] = 0xFF
    cache._values[:, :, length:] = float("nan")  # test-only poke at the slack: the public API refuses NaN
    cache._v[:, :, length:] = float("nan")
    return cache


def max_error(got, exact):
    return (got.double() - exact).abs().max().item()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decode_matches_reference(case, backend):
    if backend == "triton" and KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    batch, q_heads, kv_heads, q_len, k_len, head_dim, topk, dtype = case
    torch.manual_seed(0)
    k, v = random_kv(batch, kv_heads, k_len, head_dim, dtype)
    q = torch.randn(batch, q_len, q_heads, head_dim, device=DEVICE).to(dtype).transpose(1, 2)  # strided q

    out, lse = sfa_decode(q, filled_cache(k, v, topk), backend=backend)
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk, backend)


@pytest.mark.parametrize("case", [CASES[name] for name in ("gqa-257-d128-k16", "mqa-77-d128-k7-f16")],
                         ids=["gqa-257-d128-k16", "mqa-77-d128-k7-f16"])
def test_decode_without_the_copy_engine_reads_v_through_pointers(case, monkeypatch):
    """Where V has no TMA descriptor (GPUs before Hopper; the interpreter and the H200 take the descriptor), the
    kernel loads the V tiles through pointers, with the same result."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    monkeypatch.setattr(decode_module, "_v_tile_descriptor", lambda v: None)
    batch, q_heads, kv_heads, q_len, k_len, head_dim, topk, dtype = case
    torch.manual_seed(0)
    k, v = random_kv(batch, kv_heads, k_len, head_dim, dtype)
    q = torch.randn(batch, q_heads, q_len, head_dim, device=DEVICE).to(dtype)
    out, lse = sfa_decode(q, filled_cache(k, v, topk), backend="triton")
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk)


def assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk, backend="triton"):
    """(out, lse) of a decode step is causal SFA of q over the dense k, v it cached, within FlashAttention's rule: at
    most twice the error of the reference run in q's precision, plus a floor."""
    scale = q.shape[-1] ** -0.5
    exact, exact_lse = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True,
                                               scale=scale)
    low, low_lse = sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == F32
    assert not out.isnan().any() and not lse.isnan().any()
    floor = 1e-6
    if backend == "triton" and decode_module._INTERPRETED and q.dtype == BF16:
        # The kernel rounds P to bfloat16 for P @ V, and the interpreter rounds by truncation (the GPU to nearest):
        # one more ulp of the output.
        floor += 2.0 ** -7 * exact.abs().max().item()
    assert max_error(out, exact) <= 2 * max_error(low, exact) + floor
    assert max_error(lse, exact_lse) <= 2 * max_error(low_lse, exact_lse) + 1e-5


def test_heads_of_packed_indices_start_on_word_boundaries_which_the_kernel_checks():
    """The cache puts each head's packed indices on a 4-byte boundary, whatever the capacity (an odd capacity pads the
    head), because the kernel reads them as 4-byte words; packed indices in another layout get a clear error."""
    cache = SFAKeyCache(2, 3, 128, topk=16, dtype=BF16, device=DEVICE, capacity=5)  # 5 keys x 14 bytes: 70
    cache.append(*random_kv(2, 3, 5, 128, BF16))
    packed = cache.packed_keys()[0]
    assert packed.stride() == (3 * 72, 72, 14, 1) and packed.data_ptr() % 4 == 0
    decode_module._index_layout(packed)  # accepted
    shifted = torch.empty(packed.numel() + 2, dtype=torch.uint8, device=DEVICE)[2:].view(packed.shape)
    with pytest.raises(ValueError, match="cache: expected packed indices in the SFAKeyCache layout"):
        decode_module._index_layout(shifted)


@pytest.mark.parametrize("batch", [1, 2])
def test_one_kv_head_of_an_odd_byte_count_decodes(batch):
    """A single KV head (MQA) whose packed bytes are no multiple of 4 (capacity 301 x 2 bytes): ``view`` gives the
    head dimension a stride of 602, which the kernel never steps; the layout check accepts it."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    torch.manual_seed(0)
    k, v = random_kv(batch, 1, 5, 16, F32)
    cache = SFAKeyCache(batch, 1, 16, topk=4, dtype=F32, device=DEVICE, capacity=301)
    cache.append(k, v)
    q = torch.randn(batch, 4, 1, 16, device=DEVICE)
    out, lse = sfa_decode(q, cache, backend="triton")
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, 4)


@pytest.mark.parametrize("dtype, topk, word", [(BF16, 16, torch.int64), (BF16, 6, torch.int32), (F16, 7, F16),
                                               (F32, 2, torch.int64), (F32, 3, F32), (BF16, 1, BF16)])
def test_kernel_reads_values_as_the_widest_words_that_tile_a_key(dtype, topk, word):
    """The kernel loads each key's values as 8- or 4-byte words where they tile the key's row (so the pipeline can
    stage them), else one by one; a view, no copy, over the cache's storage."""
    cache = SFAKeyCache(1, 2, 64, topk=topk, dtype=dtype, device=DEVICE, capacity=8)
    cache.append(*random_kv(1, 2, 5, 64, dtype))
    values = cache.packed_keys()[1]
    words = decode_module._value_words(values)
    assert words.dtype == word and words.data_ptr() == values.data_ptr()
    assert words.shape[-1] * words.element_size() == topk * values.element_size()


@pytest.mark.skipif(DEVICE == "cuda", reason="a D > 256 tile is for the interpreter: on GPUs sfa_decode keeps the "
                                             "kernel to D <= 256 (kernel_blocker)")
@pytest.mark.parametrize("head_dim, topk", [(512, 9), (2048, 6)])
def test_kernel_unpacks_indices_wider_than_a_byte(head_dim, topk):
    """Called directly (sfa_decode sends D > 256 to the reference), the kernel unpacks 9-bit indices (two bytes
    each) and 11-bit ones (up to three bytes) like the reference."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    torch.manual_seed(0)
    k, v = random_kv(1, 2, 70, head_dim, F32)
    q = torch.randn(1, 4, 2, head_dim, device=DEVICE)
    cache = filled_cache(k, v, topk)
    assert cache.index_bits == head_dim.bit_length() - 1 > 8
    out, lse = sfa_decode_triton(q, cache, scale=head_dim ** -0.5)
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk)


@pytest.mark.parametrize("several_tiles", [False, True], ids=["gpu-split", "one-sm-split"])
def test_chunks_of_several_tiles_carry_the_softmax_across_tiles(monkeypatch, several_tiles):
    """The CASES above give every chunk one tile of the kernel's keys (few keys against the H200's 132 SMs), and
    their chunks take no pool. Planned for one SM (on the GPU too: the test replaces the device's SM count), 700
    keys split into chunks of several tiles and a pool of more than one unit past them, its last unit cut
    mid-tile, which the programs take over as they finish their chunks (in the interpreter, which runs programs
    one after another, the first takes it all), so the online softmax runs across tiles and units within a
    program; 2 query heads per KV head and 3 queries (the causal edge inside the last tile), D = 128, topk = 16,
    bfloat16. (gpu-split: the H200's 132 SMs, one tile per chunk, no pool.)"""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    if several_tiles:
        monkeypatch.setattr(split_k, "sm_count", lambda device: 1)
        monkeypatch.setattr(decode_module, "_POOL_FROM_TILES", 1)  # a pool at these short chunks too
    batch, q_heads, kv_heads, q_len, k_len, head_dim, topk = 1, 4, 2, 3, 700, 128, 16
    block_n = decode_module._BLOCK_N
    work = decode_module.decode_plan(batch, q_heads, kv_heads, q_len, k_len, head_dim, topk, torch.device(DEVICE))
    if several_tiles:
        assert work.chunks >= 2 and work.chunk_keys >= 2 * block_n and k_len % block_n != 0
        assert len(units_of_pool(k_len - work.chunks * work.chunk_keys)) > 1
    torch.manual_seed(0)
    k, v = random_kv(batch, kv_heads, k_len, head_dim, BF16)
    q = torch.randn(batch, q_heads, q_len, head_dim, device=DEVICE).to(BF16)
    out, lse = sfa_decode(q, filled_cache(k, v, topk), backend="triton")
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk)


def test_a_step_plans_for_the_programs_an_sm_holds_of_its_kernel(monkeypatch):
    """Where an SM holds fewer programs of the compiled decode kernel than _programs_per_sm wants (on a GPU,
    split_k.programs_per_sm counts them from its shared memory and registers; here it is told 3 of 10), the step
    plans for that many: fewer chunks, the same result."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    batch, q_heads, kv_heads, q_len, k_len, head_dim, topk = 1, 4, 2, 1, 40 * decode_module._BLOCK_N, 64, 8
    wanted = decode_module._programs_per_sm(head_dim)
    asked = []

    def three(kernel, args, options, device, want):
        asked.append((kernel, want))
        return 3

    monkeypatch.setattr(split_k, "programs_per_sm", three)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 1)
    planned, partials = [], split_k.partials
    monkeypatch.setattr(split_k, "partials", lambda q, chunks: planned.append(chunks) or partials(q, chunks))
    torch.manual_seed(0)
    k, v = random_kv(batch, kv_heads, k_len, head_dim, BF16)
    q = torch.randn(batch, q_heads, q_len, head_dim, device=DEVICE).to(BF16)
    out, lse = sfa_decode(q, filled_cache(k, v, topk), backend="triton")
    assert asked == [(decode_module._sfa_decode_chunk, wanted)]
    plan = partial(decode_module.decode_plan, batch, q_heads, kv_heads, q_len, k_len, head_dim, topk,
                   torch.device(DEVICE))
    assert planned == [plan(programs_per_sm=3).chunks] and plan().chunks > planned[0]
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk)


def units_of_pool(keys: int) -> list[int]:
    """The decode step's units (tiles) for a pool of ``keys`` keys."""
    return pool_units(-(-keys // decode_module._BLOCK_N), decode_module._UNIT_TILES)


def _pooled_one_sm(monkeypatch, sms: int = 1):
    """Plans for one SM (or ``sms``) with the pool at any chunk length, and records each (table, counters) the
    decode step's query-table launch returns (so a test can read or set the counters)."""
    monkeypatch.setattr(split_k, "sm_count", lambda device: sms)
    monkeypatch.setattr(decode_module, "_POOL_FROM_TILES", 0)
    monkeypatch.setattr(split_k, "_MAX_BLOCK_M", 8)  # 16 rows per KV head in 2 row blocks
    seen = []

    def table_and_counters(*args):
        seen.append(sparse_query_table(*args))
        return seen[-1]

    monkeypatch.setattr(decode_module, "sparse_query_table", table_and_counters)
    return seen


@pytest.mark.parametrize("k_len, chunks, units", [(1700, 2, [2, 1, 1, 1, 1]), (20, 1, [1])],
                         ids=["shrinking-units", "all-pooled-under-a-tile"])
def test_every_unit_of_the_pool_is_taken_once_and_every_program_stops_at_its_first_refusal(monkeypatch, k_len,
                                                                                             chunks, units):
    """The pool's counters after a step, whatever order the programs ran in: each unit handed out counts one
    request, and each program one more when it is refused (the pool is empty) and stops, so every row block's
    counter ends at units + chunks. Planned for two SMs (a wave of 20 programs at D = 64: two chunks of 8 programs
    each) with the pool at short chunks: 1700 keys in 2 chunks and a pool of 6 tiles, which pool_units hands out as
    a unit of 2 tiles and 4 of one, the last cut mid-tile; and 20 keys, less than a tile, all in the pool (chunks of
    0 keys). Batch 2, 2 KV heads, each with 8 query heads x 2 queries = 16 rows in 2 row blocks of 8: 8 counters,
    each indexed by batch, KV head and row block."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    seen = _pooled_one_sm(monkeypatch, sms=2)
    batch, q_heads, kv_heads, q_len, head_dim, topk = 2, 16, 2, 2, 64, 8
    block_n = decode_module._BLOCK_N
    work = decode_module.decode_plan(batch, q_heads, kv_heads, q_len, k_len, head_dim, topk, torch.device(DEVICE))
    pool = k_len - work.chunks * work.chunk_keys
    assert (work.row_blocks, work.chunks, units_of_pool(pool)) == (2, chunks, units)
    assert pool % block_n != 0  # the last unit cut mid-tile
    torch.manual_seed(0)
    k, v = random_kv(batch, kv_heads, k_len, head_dim, BF16)
    q = torch.randn(batch, q_heads, q_len, head_dim, device=DEVICE).to(BF16)
    out, lse = sfa_decode(q, filled_cache(k, v, topk), backend="triton")
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, topk)
    (_, counters), = seen
    assert counters.tolist() == [len(units) + chunks] * (batch * kv_heads * work.row_blocks)


def test_pool_units_halve_down_to_single_tiles_and_cover_the_pool():
    """pool_units: about half the pool in units of the largest size, half of the rest in units of half that, down
    to single tiles, in that order, summing to the pool; a pool too small for a large unit starts smaller; the
    largest unit must be a power of two."""
    assert pool_units(27, largest=4) == [4, 4, 4] + [2, 2, 2] + [1] * 9
    assert pool_units(6, largest=4) == [2, 1, 1, 1, 1]
    assert pool_units(1, largest=4) == [1] and pool_units(0, largest=4) == []
    assert pool_units(5, largest=1) == [1] * 5
    for tiles in range(200):
        sizes = pool_units(tiles, decode_module._UNIT_TILES)
        assert sum(sizes) == tiles and sizes == sorted(sizes, reverse=True)
    for largest in (0, 3, 6):
        with pytest.raises(ValueError, match="largest: expected a power of two >= 1"):
            pool_units(10, largest)


if triton is not None:
    @triton.jit
    def _pool_units_kernel(OUT, pool_start, k_len, BLOCK_N: tl.constexpr, LEVELS: tl.constexpr):
        """Grid (tickets,): OUT[2 t], OUT[2 t + 1] = pool_unit(t, ...)."""
        ticket = tl.program_id(0)
        start, stop = pool_unit(ticket, pool_start, k_len, BLOCK_N, LEVELS)
        tl.store(OUT + 2 * ticket, start)
        tl.store(OUT + 2 * ticket + 1, stop)


@pytest.mark.parametrize("largest", [1, 4, 8])
def test_the_kernel_hands_out_the_units_of_pool_units_and_nothing_past_them(largest):
    """The kernel's pool_unit against pool_units, ticket by ticket: unit t is [pool_start + (sum of the sizes before
    t) * BLOCK_N, that + its size * BLOCK_N) cut at k_len, and tickets past the last unit start at or past k_len;
    for pools of 0 to 40 tiles (so empty ones, ones too small for a large unit, multiples of the largest and not),
    the cache's end mid-tile or not, from pool_start 0 or 3 tiles, and pool_start past the end (a fixed plan's
    chunks may reach past the cache: no unit)."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    block_n = decode_module._BLOCK_N
    for pool_start in (0, 3 * block_n):
        for k_len in range(pool_start - block_n, pool_start + 40 * block_n, 7):
            units = pool_units(max(0, -(-(k_len - pool_start) // block_n)), largest)
            tickets = len(units) + 3
            got = torch.full((tickets, 2), -1, dtype=torch.int32, device=DEVICE)
            _pool_units_kernel[(tickets,)](got, pool_start, k_len, BLOCK_N=block_n, LEVELS=unit_levels(largest))
            starts = [pool_start + sum(units[:t]) * block_n for t in range(len(units))]
            expected = [[start, min(start + size * block_n, k_len)] for start, size in zip(starts, units)]
            assert got[:len(units)].tolist() == expected, (pool_start, k_len)
            assert (got[len(units):, 0] >= k_len).all(), (pool_start, k_len)


@pytest.mark.parametrize("taken", [1, 4], ids=["first-unit-taken", "all-but-the-last-taken"])
def test_units_other_programs_took_are_not_taken_again(monkeypatch, taken):
    """Where units of the pool are handed out, only the program that got each reads its keys, and the kernel hands
    out the units of pool_units: with the counters set after the query-table launch as if other programs had taken
    the pool's first ``taken`` units (the interpreter runs programs one after another, so otherwise the first takes
    all), the step's output is SFA over every key but those units' (the first: 4 tiles; all but the last: 4 + 2 + 1
    + 1 tiles, leaving the last, cut at the cache's end). One query (it attends every key, so the keys left are a
    plain set), 1700 keys in 5 chunks and a pool of 9 tiles."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    seen = _pooled_one_sm(monkeypatch)
    original = decode_module.sparse_query_table

    def units_taken(*args):
        table, counters = original(*args)
        counters.fill_(taken)
        return table, counters

    monkeypatch.setattr(decode_module, "sparse_query_table", units_taken)
    batch, q_heads, kv_heads, q_len, k_len, head_dim, topk = 1, 4, 2, 1, 1700, 64, 8
    block_n = decode_module._BLOCK_N
    work = decode_module.decode_plan(batch, q_heads, kv_heads, q_len, k_len, head_dim, topk, torch.device(DEVICE))
    pool_start = work.chunks * work.chunk_keys
    units = units_of_pool(k_len - pool_start)
    assert (work.chunks, units) == (5, [4, 2, 1, 1, 1])
    taken_keys = sum(units[:taken]) * block_n
    assert not seen
    torch.manual_seed(0)
    k, v = random_kv(batch, kv_heads, k_len, head_dim, BF16)
    q = torch.randn(batch, q_heads, q_len, head_dim, device=DEVICE).to(BF16)
    out, lse = sfa_decode(q, filled_cache(k, v, topk), backend="triton")
    kept = torch.cat([torch.arange(pool_start), torch.arange(pool_start + taken_keys, k_len)]).to(DEVICE)
    assert_sfa_of_the_dense_keys(out, lse, q, k[:, :, kept], v[:, :, kept], topk)


def test_pooled_plan_leaves_at_least_its_fraction_to_the_pool_in_whole_tiles():
    """split_k.plan(pooled=p): the same programs as the fixed plan, chunks of whole tiles, at least p of the tiles
    left past them (never none); pooled=0 is the fixed plan, whose chunks cover every key."""
    device, block_n = torch.device(DEVICE), decode_module._BLOCK_N
    for k_len in (20, 700, 8192, 32768, 131072, 131072 + 5):
        fixed = split_k.plan(1, 32, 8, 1, k_len, device, block_n=block_n, programs_per_sm=8)
        pooled = split_k.plan(1, 32, 8, 1, k_len, device, block_n=block_n, programs_per_sm=8, pooled=0.1)
        tiles = -(-k_len // block_n)
        assert fixed.chunks * fixed.chunk_keys >= k_len > (fixed.chunks - 1) * fixed.chunk_keys
        assert pooled.chunk_keys % block_n == 0 and pooled.block_m == fixed.block_m
        assert pooled.chunks == min(tiles, 132) and tiles - pooled.chunks * pooled.chunk_keys // block_n >= 0.1 * tiles


@pytest.mark.parametrize("k_len, topk, chunk_tiles, pooled_tiles", [
    (16384, 16, 4, 0), (32768, 8, 6, 232), (32768, 16, 7, 100), (131072, 8, 27, 532), (131072, 15, 27, 532),
    (131072, 16, 29, 268), (131072, 128, 29, 268)])
def test_decode_plan_on_an_h200_pools_a_twentieth_from_topk_16_and_a_tenth_below(k_len, topk, chunk_tiles,
                                                                                  pooled_tiles):
    """The plans session 47 measured (GQA 32/8, one query, D = 128, the H200's 132 SMs at 8 programs each: 132
    chunks per KV head): from chunks of _POOL_FROM_TILES tiles on (32K), a pool of at least 10% of the tiles below
    topk = 16 and 5% from it on; 16K's 4-tile chunks cover every key."""
    work = decode_module.decode_plan(1, 32, 8, 1, k_len, 128, topk, torch.device("cpu"))
    tiles = k_len // decode_module._BLOCK_N
    assert (work.block_m, work.row_blocks) == (4, 1)
    assert (work.chunks, work.chunk_keys // decode_module._BLOCK_N) == (min(132, tiles // chunk_tiles), chunk_tiles)
    assert tiles - work.chunks * chunk_tiles == pooled_tiles


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("head_dim, topk", [(16, 1), (64, 7), (128, 16), (128, 128)])
@pytest.mark.parametrize("kv_heads, block_m", [(1, 4), (1, 16), (3, 8)], ids=["mqa-4-blocks", "mqa-one-block", "mha"])
def test_kernel_sparsifies_queries_like_codes_sparsify_ties_included(dtype, head_dim, topk, kv_heads, block_m):
    """The decode kernel's query table (one launch) holds codes.sparsify exactly, each query row in its column of its
    row block (and the launch zeroes the decode kernel's pool counters, one per row block), on strided queries whose
    magnitudes repeat (values from {0, +-0.5, +-1, +-2}, -0.0 included), so ties decide the kept coordinates: the
    lower index wins. 3 query heads x 5 queries: 15 rows per KV head over 4 blocks of 4 (one padding column) or one of
    16 under MQA, 5 rows in a block of 8 under MHA."""
    if KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    torch.manual_seed(0)
    levels = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0], device=DEVICE)
    q = levels[torch.randint(0, 8, (2, 5, 3, head_dim), device=DEVICE)].to(dtype).transpose(1, 2)  # [2, 3, 5, D]
    batch, q_heads, q_len, _ = q.shape
    rows = q_heads // kv_heads * q_len
    table, counters = sparse_query_table(q, topk, kv_heads, block_m)
    assert table.is_contiguous() and table.dtype == dtype
    assert table.shape == (batch, kv_heads, -(-rows // block_m), head_dim, block_m)
    assert counters.dtype == torch.int32 and counters.tolist() == [0] * (batch * kv_heads * -(-rows // block_m))
    # [B, Hkv, blocks, D, block_m] -> rows r = (h % G) * Tq + i of each KV head -> [B, Hq, Tq, D]
    columns = table.transpose(-1, -2).reshape(batch, kv_heads, -1, head_dim)
    got = columns[:, :, :rows].reshape(q.shape)
    want = sparsify(q, topk)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert not columns[:, :, rows:].any()  # the last block's padding columns are 0


@pytest.mark.parametrize("head_dim, topk", [(48, 6), (300, 11)])
def test_reference_in_float64_is_sfa_of_the_dense_keys_one_block_at_a_time(monkeypatch, head_dim, topk):
    """In float64 the decode reference equals sfa_attention_reference to rounding, while densifying at most
    ``block_keys`` cached keys per call. The reference takes any head dim: D = 48 (6-bit indices), D = 300 (9-bit
    indices, int16 once unpacked)."""
    densified = []

    def recording_scatter(indices, values, dim):
        densified.append(indices.shape[2])
        return densify(indices, values, dim)

    monkeypatch.setattr(decode_module, "scatter_codes", recording_scatter)
    torch.manual_seed(0)
    k, v = random_kv(2, 2, 100, head_dim, F64)
    q = torch.randn(2, 4, 3, head_dim, dtype=F64, device=DEVICE)
    cache = SFAKeyCache(2, 2, head_dim, topk=topk, dtype=F64, device=DEVICE)
    cache.append(k, v)
    out, lse = sfa_decode_reference(q, cache, scale=0.3, block_keys=16)
    want, want_lse = sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=0.3)
    assert densified == [16] * 6 + [4]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_auto_uses_the_kernel_on_cuda_only():
    q = torch.randn(1, 2, 1, 32, device=DEVICE)
    expected = "triton" if DEVICE == "cuda" and KERNEL_BLOCKER is None else "reference"
    assert decode_module._resolve_backend(q, "auto") == expected
    assert decode_module._resolve_backend(q.double(), "auto") == "reference"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_step_of_no_query_heads_returns_empty_outputs(backend):
    """Hq = 0 divides every cache's KV heads; the kernel's plan divided by zero before."""
    if backend == "triton" and KERNEL_BLOCKER:
        pytest.skip(KERNEL_BLOCKER)
    out, lse = sfa_decode(tokens(1, heads=0), make_cache(), backend=backend)
    assert out.shape == (1, 0, 1, 32) and lse.shape == (1, 0, 1)


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------------------------

def make_cache(topk=4, head_dim=32, dtype=BF16, length=5):
    cache = SFAKeyCache(1, 2, head_dim, topk=topk, dtype=dtype, device=DEVICE, capacity=4)
    if length:
        cache.append(*random_kv(1, 2, length, head_dim, dtype))
    return cache


def tokens(length=2, heads=2, head_dim=32, dtype=BF16):
    return torch.randn(1, heads, length, head_dim, device=DEVICE).to(dtype)


def codes(topk=4, length=2, head_dim=32):
    return sparse_codes(tokens(length, head_dim=head_dim), topk)


def with_nan(t):
    return t.clone().fill_(float("nan"))


BAD_CALLS = {
    "topk-0": ("topk", lambda: SFAKeyCache(1, 2, 32, topk=0)),
    "topk-above-D": ("topk", lambda: SFAKeyCache(1, 2, 32, topk=33)),
    "integer-dtype": ("dtype", lambda: SFAKeyCache(1, 2, 32, topk=4, dtype=torch.int32)),
    "capacity-0": ("capacity", lambda: SFAKeyCache(1, 2, 32, topk=4, capacity=0)),
    "k-wrong-dtype": ("k", lambda: make_cache().append(tokens(dtype=F16), tokens())),
    "k-wrong-heads": ("k", lambda: make_cache().append(tokens(heads=4), tokens(heads=4))),
    "k-wrong-D": ("k", lambda: make_cache().append(tokens(head_dim=64), tokens(head_dim=64))),
    "k-no-tokens": ("k", lambda: make_cache().append(tokens(length=0), tokens(length=0))),
    "k-not-a-tensor": ("k", lambda: make_cache().append([1.0], tokens())),
    "k-nan": ("k", lambda: make_cache().append(with_nan(tokens()), tokens())),
    "v-other-length": ("v", lambda: make_cache().append(tokens(length=2), tokens(length=3))),
    "indices-wrong-dtype": ("indices", lambda: make_cache().append_codes(codes()[0].long(), codes()[1], tokens())),
    "indices-of-another-topk": ("indices", lambda: make_cache().append_codes(*codes(topk=8), tokens())),
    "indices-of-another-D": ("indices", lambda: make_cache().append_codes(*codes(head_dim=64), tokens())),
    "indices-out-of-range": ("indices",
                             lambda: make_cache().append_codes(codes()[0] + 200, codes()[1], tokens())),
    "indices-equal-to-D": ("indices", lambda: make_cache().append_codes(
        torch.cat([torch.full_like(codes()[0][..., :1], 32), codes()[0][..., 1:]], dim=-1), codes()[1], tokens())),
    "v-other-length-than-codes": ("v", lambda: make_cache().append_codes(*codes(length=1), tokens(length=3))),
    "indices-repeated": ("indices",
                         lambda: make_cache().append_codes(codes()[0][..., :1].repeat(1, 1, 1, 4), codes()[1],
                                                           tokens())),
    "values-wrong-dtype": ("values", lambda: make_cache().append_codes(codes()[0], codes()[1].float(), tokens())),
    "keys-stop-past-length": ("stop", lambda: make_cache().keys(0, 6)),
    "keys-start-after-stop": ("start", lambda: make_cache().keys(3, 2)),
    "pack-float-indices": ("indices", lambda: pack_indices(torch.zeros(2, 3), 128)),
    "pack-no-indices": ("indices", lambda: pack_indices(torch.zeros(2, 0, dtype=torch.long), 128)),
    "pack-dim-0": ("dim", lambda: pack_indices(torch.zeros(2, 3, dtype=torch.long), 0)),
    "unpack-wrong-byte-count": ("packed", lambda: unpack_indices(torch.zeros(2, 16, dtype=torch.uint8), 128, 16)),
    "unpack-not-uint8": ("packed", lambda: unpack_indices(torch.zeros(2, 14, dtype=torch.int32), 128, 16)),
    "unpack-topk-0": ("topk", lambda: unpack_indices(torch.zeros(2, 1, dtype=torch.uint8), 128, 0)),
    "decode-not-a-cache": ("cache", lambda: sfa_decode(tokens(1), None)),
    "decode-cache-of-another-D": ("cache", lambda: sfa_decode(tokens(1, head_dim=64), make_cache())),
    "decode-cache-of-another-dtype": ("cache", lambda: sfa_decode(tokens(1, dtype=F32), make_cache())),
    "decode-cache-of-another-batch": ("cache", lambda: sfa_decode(tokens(1).expand(2, -1, -1, -1), make_cache())),
    "decode-more-queries-than-cached": ("cache", lambda: sfa_decode(tokens(6), make_cache())),
    "decode-empty-cache": ("cache", lambda: sfa_decode(tokens(1), make_cache(length=0))),
    "decode-heads-not-a-multiple": ("q", lambda: sfa_decode(tokens(1, heads=3), make_cache())),
    "decode-3d-q": ("q", lambda: sfa_decode(tokens(1)[0], make_cache())),
    "decode-int-q": ("q", lambda: sfa_decode(tokens(1).long(), make_cache())),
    "decode-nan-q": ("q", lambda: sfa_decode(with_nan(tokens(1)), make_cache())),
    "decode-bad-scale": ("scale", lambda: sfa_decode(tokens(1), make_cache(), scale=-1.0)),
    "decode-infinite-scale": ("scale", lambda: sfa_decode(tokens(1), make_cache(), scale=float("inf"))),
    "decode-triton-under-autograd": ("backend", lambda: sfa_decode(tokens(1).requires_grad_(), make_cache(),
                                                                   backend="triton")),
    "decode-unknown-backend": ("backend", lambda: sfa_decode(tokens(1), make_cache(), backend="cuda")),
    "decode-triton-float64": ("backend", lambda: sfa_decode(tokens(1, dtype=F64), make_cache(dtype=F64),
                                                            backend="triton")),
}


@pytest.mark.parametrize("name, call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_inputs_name_the_argument(name, call):
    with pytest.raises(ValueError, match=rf"^{name}: expected "):
        call()


def test_auto_decodes_through_the_reference_where_autograd_records(monkeypatch):
    """The decode kernel has no backward: under autograd "auto" takes the reference, whose output reaches q."""
    monkeypatch.setattr(decode_module, "choose_backend", lambda backend, q, blocker: (
        "reference" if blocker else "triton"))  # as auto on a GPU the kernels can serve
    q = tokens(1).requires_grad_()
    out, _ = sfa_decode(q, make_cache())
    out.float().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_skip_nan_checks_lets_nan_through_and_keeps_the_other_checks():
    """Inside sieve_attn.skip_nan_checks() a NaN query gives NaN rows instead of a ValueError, an append of NaN keys
    is taken, a bad shape is still refused; the checks come back after the block, also after an exception in it."""
    from sieve_attn import skip_nan_checks

    with skip_nan_checks():
        with skip_nan_checks():
            pass
        cache = make_cache()
        cache.append(with_nan(tokens(1)), tokens(1))
        out, lse = sfa_decode(with_nan(tokens(1)), make_cache(), backend="reference")
        assert out.isnan().all() and lse.isnan().all()
        with pytest.raises(ValueError, match="^cache: expected a cache of q's head dim"):
            sfa_decode(with_nan(tokens(1, head_dim=64)), make_cache())
    with pytest.raises(RuntimeError), skip_nan_checks():
        raise RuntimeError("leaves the block")
    with pytest.raises(ValueError, match="^q: expected no NaN values"):
        sfa_decode(with_nan(tokens(1)), make_cache())


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA notion")
def test_decode_step_without_nan_checks_never_waits_for_the_gpu():
    """A decode step (append the new token, then sfa_decode on the Triton kernel) inside skip_nan_checks() queues
    its work without one host synchronisation: torch's sync debug mode turns any into an error."""
    from sieve_attn import skip_nan_checks

    torch.manual_seed(0)
    k, v = random_kv(1, 2, 65, 64, BF16)
    cache = SFAKeyCache(1, 2, 64, topk=8, dtype=BF16, device=DEVICE, capacity=128)
    cache.append(k[:, :, :64], v[:, :, :64])
    q = torch.randn(1, 8, 1, 64, device=DEVICE, dtype=BF16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with skip_nan_checks():
            cache.append(k[:, :, 64:], v[:, :, 64:])
            out, lse = sfa_decode(q, cache, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_sfa_of_the_dense_keys(out, lse, q, k, v, 8)
