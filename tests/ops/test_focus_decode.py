"""focus_decode (Triton) against the plain-PyTorch Focus reference.

On a machine without CUDA the kernels run in the Triton interpreter. The interpreter is chosen when a kernel is
decorated, i.e. when sieve_attn.ops.focus.decode is first imported, so TRITON_INTERPRET must be set before that
import: tests/conftest.py sets it for the session, and this module again (setdefault) so that it does not depend on
that file. If the module was imported without the variable anyway, the kernel tests skip.
"""
from __future__ import annotations

import os
from functools import partial

import numpy
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from sieve_attn.ops import split_k  # noqa: E402
from sieve_attn.ops.focus import decode  # noqa: E402
from sieve_attn.ops.focus.decode import focus_decode  # noqa: E402
from sieve_attn.ops.focus.reference import focus_attention_reference, focus_pair_mask, group_bits  # noqa: E402

INTERPRETED = decode._INTERPRETED
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED,
    reason="no CUDA, and sieve_attn.ops.focus.decode was imported before TRITON_INTERPRET=1 was set (by another "
           "test module?); run with TRITON_INTERPRET=1 in the environment")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# (batch, q_heads, kv_heads, q_len, k_len, head_dim, window, num_groups, slots, dtype, softcap, strided)
CASES = {
    "one-key": (1, 2, 2, 1, 1, 32, 0, 1, 1, F32, None, False),
    "mha-window0-two-slots-softcap": (2, 2, 2, 3, 63, 64, 0, 62, 2, F32, 5.0, True),
    "gqa-window5-two-slots": (1, 4, 2, 3, 257, 64, 5, 62, 2, BF16, None, False),
    "mqa-window-past-keys-softcap": (2, 3, 1, 1, 257, 32, 300, 4, 1, BF16, 2.0, True),
    "mqa-window5-softcap": (1, 3, 1, 3, 257, 32, 5, 62, 1, F32, 2.0, False),
    "two-row-blocks": (1, 8, 1, 9, 100, 32, 5, 8, 2, F32, None, True),
    # More queries than a row block holds: each block scans its own rows' positions, not all of them.
    "queries-past-a-row-block": (1, 2, 1, 70, 300, 32, 5, 8, 2, F32, None, False),
    "fp16-d128": (1, 4, 2, 2, 257, 128, 5, 16, 2, F16, 5.0, False),
    "d256": (1, 2, 1, 1, 129, 256, 5, 8, 2, BF16, None, False),
}


def random_groups(batch, length, num_groups, slots):
    """[B, T, slots] distinct ids per token, some slots -1 (each token keeps at least one id)."""
    ids = torch.rand(batch, length, num_groups).argsort(dim=-1)[..., :slots]
    empty = torch.rand(batch, length, slots) < 0.4
    empty[..., 0] = False
    return ids.masked_fill(empty, -1)


def make_inputs(batch, q_heads, kv_heads, q_len, k_len, head_dim, dtype, strided):
    """q, k, v in ``dtype``; strided: q a transposed [B, Tq, H, D], k and v views of a longer cache."""
    pad = 7 if strided else 0
    q = torch.randn(batch, q_len, q_heads, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(batch, kv_heads, k_len + pad, head_dim, device=DEVICE, dtype=dtype)[:, :, :k_len]
            for _ in range(2))
    return (q if strided else q.contiguous()), k, v


def poisoned(t, where):
    """A copy of ``t`` with its strides, NaN where ``where`` (broadcast) is True."""
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    return copy.masked_fill_(where, float("nan"))


def max_error(got, exact):
    return (got.double() - exact).abs().max().item()


@needs_kernels
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case):
    batch, q_heads, kv_heads, q_len, k_len, head_dim, window, num_groups, slots, dtype, softcap, strided = case
    torch.manual_seed(0)
    q, k, v = make_inputs(batch, q_heads, kv_heads, q_len, k_len, head_dim, dtype, strided)
    groups = random_groups(batch, k_len, num_groups, slots).to(DEVICE)
    scale = head_dim ** -0.5
    kwargs = dict(window=window, causal=True, scale=scale, softcap=softcap)
    exact, exact_lse = focus_attention_reference(q.double(), k.double(), v.double(), groups, **kwargs)
    low, low_lse = focus_attention_reference(q, k, v, groups, **kwargs)

    # Keys no query attends are NaN for the kernel: reading one (or adding 0 * NaN) would show in the output.
    q_pos = torch.arange(k_len - q_len, k_len, device=DEVICE)
    k_pos = torch.arange(k_len, device=DEVICE)
    pairs = focus_pair_mask(groups, window)(q_pos, k_pos) & (k_pos[None, :] <= q_pos[:, None])
    unread = ~pairs.any(dim=1)[:, None, :, None]  # [B, 1, Tk, 1]
    out, lse = focus_decode(q, poisoned(k, unread), poisoned(v, unread), group_bits(groups), window=window,
                            scale=scale, softcap=softcap)

    assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:3] and lse.dtype == F32
    assert not out.isnan().any() and not lse.isnan().any()
    # FlashAttention's rule: at most twice the error of the reference run in the low precision, plus a floor.
    floor = 1e-6
    if INTERPRETED and dtype == BF16:
        # The interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest): one more ulp.
        floor += 2.0 ** -7 * exact.abs().max().item()
    assert max_error(out, exact) <= 2 * max_error(low, exact) + floor
    assert max_error(lse, exact_lse) <= 2 * max_error(low_lse, exact_lse) + 1e-5


@needs_kernels
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("sms", [1, 3])
def test_chunks_of_many_tiles_match_reference(sms, head_dim, monkeypatch):
    """Few programs (a GPU of 1 or 3 SMs, one program per SM): each chunk spans several key tiles, so the attended
    positions of later tiles are appended after the earlier ones' in the program's list (at 128K on an H200 a chunk
    holds 21 tiles of 64 keys at D = 128, 21 of 128 at D = 64; the other tests plan one tile per chunk). Both tile sizes: 128 keys
    at D = 32, 64 at D = 128."""
    monkeypatch.setattr(split_k, "sm_count", lambda device: sms)
    monkeypatch.setattr(decode, "_PROGRAMS_PER_SM", 1)
    torch.manual_seed(0)
    q, k, v = make_inputs(1, 4, 2, 2, 600, head_dim, F32, strided=False)
    groups = random_groups(1, 600, 8, 2).to(DEVICE)
    work = split_k.plan(1, 4, 2, 2, 600, q.device, block_n=decode._block_n(head_dim), programs_per_sm=1)
    assert work.chunk_keys >= 3 * decode._block_n(head_dim)
    kwargs = dict(window=5, causal=True, scale=head_dim ** -0.5, softcap=None)
    exact, exact_lse = focus_attention_reference(q.double(), k.double(), v.double(), groups, **kwargs)
    out, lse = focus_decode(q, k, v, group_bits(groups), window=5, scale=head_dim ** -0.5)
    assert max_error(out, exact) < 1e-5 and max_error(lse, exact_lse) < 1e-5


@needs_kernels
def test_a_step_plans_for_the_programs_an_sm_holds_of_its_kernel(monkeypatch):
    """Where an SM holds fewer programs of the compiled kernel than _PROGRAMS_PER_SM (on a GPU,
    split_k.programs_per_sm counts them; here it is told 1 of 3), the step plans for that many: fewer chunks, the
    same result."""
    monkeypatch.setattr(split_k, "sm_count", lambda device: 4)
    asked, planned, partials = [], [], split_k.partials
    monkeypatch.setattr(split_k, "programs_per_sm",
                        lambda kernel, args, options, device, wanted: asked.append((kernel, wanted)) or 1)
    monkeypatch.setattr(split_k, "partials", lambda q, chunks: planned.append(chunks) or partials(q, chunks))
    torch.manual_seed(0)
    q, k, v = make_inputs(1, 4, 2, 2, 600, 32, F32, strided=False)
    groups = random_groups(1, 600, 8, 2).to(DEVICE)
    kwargs = dict(window=5, causal=True, scale=32 ** -0.5, softcap=None)
    exact, exact_lse = focus_attention_reference(q.double(), k.double(), v.double(), groups, **kwargs)
    out, lse = focus_decode(q, k, v, group_bits(groups), window=5, scale=32 ** -0.5)
    assert asked == [(decode._focus_decode_chunk, decode._PROGRAMS_PER_SM)]
    plan = partial(split_k.plan, 1, 4, 2, 2, 600, q.device, block_n=decode._block_n(32),
                   max_chunk_tiles=decode._MAX_CHUNK_TILES)
    assert planned == [plan(programs_per_sm=1).chunks]
    assert plan(programs_per_sm=decode._PROGRAMS_PER_SM).chunks > planned[0]
    assert max_error(out, exact) < 1e-5 and max_error(lse, exact_lse) < 1e-5


@needs_kernels
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("scan_n, scan_stages", [(16, 1), (16, 3), (256, 1), (256, 2)])
def test_scan_steps_do_not_change_the_output(scan_n, scan_stages, head_dim, monkeypatch):
    """Pass 1's step (keys per step, pipeline stages) changes how the chunk's bit sets are read, not the list of
    attended positions it writes (in position order) nor anything after it: the same output and lse, bit for bit,
    over chunks of several tiles (of 128 keys at D = 32, 64 at D = 128)."""
    monkeypatch.setattr(split_k, "sm_count", lambda device: 1)
    monkeypatch.setattr(decode, "_PROGRAMS_PER_SM", 1)
    torch.manual_seed(1)
    q, k, v = make_inputs(1, 4, 2, 2, 600, head_dim, F32, strided=False)
    bits = group_bits(random_groups(1, 600, 8, 2).to(DEVICE))
    expected = focus_decode(q, k, v, bits, window=5, scale=head_dim ** -0.5)
    monkeypatch.setattr(decode, "_SCAN_N", scan_n)
    monkeypatch.setattr(decode, "_SCAN_STAGES", scan_stages)
    got = focus_decode(q, k, v, bits, window=5, scale=head_dim ** -0.5)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_plan_fills_an_h200_in_whole_waves_of_bounded_chunks():
    """Batch 1, 8 KV heads, one query, D = 128 on an H200's 132 SMs (the CPU plans for those): chunks of whole tiles
    cover the keys, none holds more than _MAX_CHUNK_TILES tiles, and the programs come in as few waves of
    _PROGRAMS_PER_SM per SM as that allows: one up to 64K keys, two at 128K, 11 at 1M."""
    block_n = decode._block_n(128)
    one_wave = decode._PROGRAMS_PER_SM * 132 // 8  # chunks per KV head
    for k_len, waves in ((8192, 1), (65536, 1), (131072, 2), (131072 + 5, 2), (1 << 20, 11)):
        work = split_k.plan(1, 32, 8, 1, k_len, torch.device("cpu"), block_n=block_n,
                            programs_per_sm=decode._PROGRAMS_PER_SM, max_chunk_tiles=decode._MAX_CHUNK_TILES)
        chunk_keys, chunks = work.chunk_keys, work.chunks
        assert chunk_keys % block_n == 0 and chunks * chunk_keys >= k_len > (chunks - 1) * chunk_keys
        assert chunk_keys <= decode._MAX_CHUNK_TILES * block_n
        assert (waves - 1) * one_wave < chunks <= waves * one_wave, (k_len, chunks)


@pytest.mark.skipif(not INTERPRETED, reason="records the interpreter's loads")
def test_reads_each_attended_key_once_and_no_other(monkeypatch):
    """Every K and V element the kernel loads belongs to a key some query attends, and each such row is loaded
    exactly once per KV head (NaN values cannot show this for K: masked logits never reach the output)."""
    from triton.runtime.interpreter import InterpreterBuilder

    loaded = []
    load = InterpreterBuilder.create_masked_load

    def recording_load(self, ptrs, mask, *args):
        loaded.append(ptrs.data[mask.data])
        return load(self, ptrs, mask, *args)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", recording_load)
    batch, q_heads, kv_heads, q_len, k_len, head_dim, window = 2, 4, 2, 3, 257, 32, 5
    torch.manual_seed(0)
    q, k, v = make_inputs(batch, q_heads, kv_heads, q_len, k_len, head_dim, F32, strided=False)
    groups = random_groups(batch, k_len, 16, 1)
    focus_decode(q, k, v, group_bits(groups), window=window, scale=1.0)

    q_pos, k_pos = torch.arange(k_len - q_len, k_len), torch.arange(k_len)
    pairs = focus_pair_mask(groups, window)(q_pos, k_pos) & (k_pos[None, :] <= q_pos[:, None])
    attended = pairs.any(dim=1)[:, None, :].expand(batch, kv_heads, k_len)  # [B, Hkv, Tk]
    addresses = torch.from_numpy(numpy.concatenate(loaded).astype("int64"))
    for cache in (k, v):
        offsets = (addresses - cache.data_ptr()) // cache.element_size()
        offsets = offsets[(offsets >= 0) & (offsets < cache.numel())]
        rows = torch.bincount(offsets // head_dim, minlength=batch * kv_heads * k_len).view(batch, kv_heads, k_len)
        assert torch.equal(rows, attended * head_dim)
    assert attended.float().mean() < 0.5  # the pattern is sparse enough for the check to mean something


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA notion")
def test_decode_step_with_validated_groups_without_nan_checks_never_waits_for_the_gpu():
    """focus_attention of one new query over a cache, given FocusGroups validated when the tokens came, inside
    sieve_attn.skip_nan_checks(): its work is queued without one host synchronisation (torch's sync debug mode
    turns any into an error), and it equals the reference (loosely: the kernel's accuracy is
    test_matches_reference's)."""
    from sieve_attn import focus_attention, skip_nan_checks
    from sieve_attn.ops.focus.groups import FocusGroups

    torch.manual_seed(0)
    k_len = 300
    q = torch.randn(1, 8, 1, 64, device=DEVICE, dtype=BF16)
    k, v = (torch.randn(1, 2, k_len, 64, device=DEVICE, dtype=BF16) for _ in range(2))
    ids = random_groups(1, k_len, 8, 2).to(DEVICE)
    groups = FocusGroups.of(ids, 1, k_len, q.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with skip_nan_checks():
            out = focus_attention(q, k, v, groups, window=16, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want, _ = focus_attention_reference(q.float(), k.float(), v.float(), ids, window=16, causal=True,
                                        scale=64 ** -0.5, softcap=None, attn_mask=None, out=None)
    torch.testing.assert_close(out.float(), want, rtol=0, atol=2e-2)


def test_offsets_past_int32_are_refused():
    """A K view whose offsets within one head pass 2**31 (e.g. a long [B, T, Hkv, D] buffer) is refused, not read
    with wrapped offsets. Meta tensors: only shapes and strides are read before the kernel."""
    q = torch.empty(1, 2, 1, 16, device="meta")
    k = torch.empty_strided((1, 1, 3, 16), (2 ** 32, 2 ** 32, 2 ** 30, 1), device="meta")
    bits = torch.empty(1, 3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="k: expected strides whose offsets within one KV head fit int32"):
        focus_decode(q, k, k, bits, window=1, scale=1.0)


@pytest.mark.skipif(not INTERPRETED, reason="records the interpreter's stores")
def test_each_program_lists_its_keys_in_its_own_scratch_slice(monkeypatch):
    """The interpreter runs programs one after another, so a list shared between programs would still give right
    outputs there; on a GPU they run at once. The int32 stores (the lists of attended positions, nothing else is
    int32) of different programs must therefore hit disjoint address ranges, each within its program's slice of
    ``chunk_keys`` entries."""
    from triton.runtime.interpreter import InterpreterBuilder

    stores: dict = {}
    store = InterpreterBuilder.create_masked_store

    def recording_store(self, ptrs, value, mask, *args):
        if value.data.dtype == numpy.int32:
            stores.setdefault(tuple(self.grid_idx), []).append(ptrs.data[mask.data])
        return store(self, ptrs, value, mask, *args)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", recording_store)
    torch.manual_seed(0)
    q, k, v = make_inputs(2, 4, 2, 1, 600, 32, F32, strided=False)
    focus_decode(q, k, v, group_bits(random_groups(2, 600, 8, 1)), window=5, scale=1.0)
    work = split_k.plan(2, 4, 2, 1, 600, q.device, block_n=decode._block_n(32),
                        programs_per_sm=decode._PROGRAMS_PER_SM, max_chunk_tiles=decode._MAX_CHUNK_TILES)
    chunk_keys = work.chunk_keys
    spans = sorted((int(a.min()), int(a.max())) for a in (numpy.concatenate(s) for s in stores.values()))
    assert len(spans) == 2 * 2 * work.chunks * work.row_blocks > 8  # every program found attended keys
    for (low, high), (next_low, _) in zip(spans, spans[1:]):
        assert high - low < 4 * chunk_keys and high < next_low


@needs_kernels
@pytest.mark.parametrize("batch, q_heads", [(0, 4), (1, 0)], ids=["no-batch", "no-query-heads"])
def test_an_empty_step_returns_empty_outputs(batch, q_heads):
    """An empty batch or query-head set plans a grid of no programs (the plan divided by zero before)."""
    q, k, v = make_inputs(batch, q_heads, 2, 1, 40, 32, F32, False)
    out, lse = focus_decode(q, k, v, group_bits(random_groups(batch, 40, 4, 1).to(DEVICE)), window=5,
                            scale=0.2, softcap=None)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
