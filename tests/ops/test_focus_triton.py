"""Triton pair-set kernels of hard Focus attention (backend="triton", Tq == Tk) against the fp64 reference.

Rule (FlashAttention's): the kernel's error against fp64 is at most twice the error of PyTorch's own attention in the
same dtype (SDPA with the pattern as a mask, ``backend="dense"``) against fp64, for the output and for dq, dk, dv.
Without CUDA the kernels run in the Triton interpreter (tests/conftest.py), on tiny shapes that still cover several
layout tiles, sub-tiles and key steps per group.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from sieve_attn.ops.focus import attention, triton_prefill  # noqa: E402
from sieve_attn.ops.focus.attention import focus_attention, focus_backend  # noqa: E402
from sieve_attn.ops.focus.layout import group_layout, window_layout  # noqa: E402
from sieve_attn.ops.focus.reference import group_bits  # noqa: E402

try:
    from tests.ops.test_focus_sdpa import BF16, DEVICE, F32, check_against_reference, check_lse_and_out  # noqa: E402
except ImportError:  # pytest imported the test modules with tests/ on the path
    from ops.test_focus_sdpa import BF16, DEVICE, F32, check_against_reference, check_lse_and_out  # noqa: E402


# (batch, q_heads, kv_heads, length, head_dim, num_groups, slots, window, causal, softcap, dtype)
CASES = {
    "mha-top1": (1, 2, 2, 63, 16, 3, 1, 5, True, None, F32),
    "gqa-top2-sink": (2, 4, 2, 70, 32, 4, 2, 7, True, None, F32),
    "mqa-noncausal-softcap": (1, 3, 1, 45, 16, 5, 2, 3, False, 5.0, F32),
    "one-group-window-past-end": (1, 2, 2, 40, 16, 1, 1, 100, True, None, F32),
    "long-groups-bf16": (1, 2, 1, 150, 16, 2, 1, 40, True, None, BF16),
    "window0-bf16-top2": (1, 2, 2, 97, 64, 3, 2, 0, True, None, BF16),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_forward_and_backward(case):
    check_against_reference(case, CASES[case], "triton")


@pytest.mark.parametrize("slots", [1, 2])
def test_longest_tiles_first_changes_only_the_launch_order(slots, monkeypatch):
    """Tiling.longest_first reverses the forward's and dq's query tiles; each program still writes only its own
    rows, so out and lse are the same bit for bit, and with one slot per token the gradients too. With two, a
    token's two copies add into its dq, dk and dv rows: on the GPU in an order no launch fixes (the H200 gave
    other dk bits between two calls of the same order), so those are compared to float32 rounding."""
    import dataclasses
    torch.manual_seed(slots)
    q, k, v = (torch.randn(1, 2, 70, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    groups = torch.stack([torch.randperm(4)[:slots] for _ in range(70)]).view(1, 70, slots).to(DEVICE)
    grad = torch.randn(1, 2, 70, 16, device=DEVICE)
    orders = []

    class Recorded:  # the kernel, launched as before, with the order it was asked for recorded
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                orders.append(kwargs["LONGEST_FIRST"])
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_fwd_kernel", "_bwd_dq_kernel"):
        monkeypatch.setattr(triton_prefill, name, Recorded(getattr(triton_prefill, name)))
    results = []
    for longest_first in (True, False):
        plan = dataclasses.replace(triton_prefill.tiling(q.device), longest_first=longest_first)
        monkeypatch.setattr(triton_prefill, "tiling", lambda device, plan=plan: plan)
        out, lse = focus_attention(q, k, v, groups, window=5, backend="triton", return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), grad)))
    assert orders == [True] * 4 + [False] * 4  # two pair sets, forward and dq
    for name, first, second in zip(("out", "lse", "dq", "dk", "dv"), *results):
        if name in ("dq", "dk", "dv") and slots == 2:
            torch.testing.assert_close(first, second, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(first, second), name


@pytest.mark.parametrize("case", ["gqa-top2-sink", "window0-bf16-top2"])
def test_two_slots_per_token_merge_their_one_extra_copy_in_one_pass(case, monkeypatch):
    """ids [B, T, 2] (no sink row listing every group): each token has at most one extra copy, merged in one pass
    (the merge kernel on CUDA)."""
    passes = []
    merge_extra = triton_prefill.merge_extra_partials

    def counted(*args, one_per_row=False):
        passes.append(one_per_row)
        return merge_extra(*args, one_per_row=one_per_row)

    monkeypatch.setattr(triton_prefill, "merge_extra_partials", counted)
    check_against_reference(case, CASES[case], "triton", sink=False)
    assert passes == [True]


def test_returns_lse_of_the_reference_and_writes_out():
    check_lse_and_out("triton")


def test_group_layout_sorts_pads_and_ranks_memberships():
    groups = torch.tensor([[[1, -1], [0, 1], [1, -1], [0, -1], [1, 0]],
                           [[2, -1], [2, -1], [0, -1], [2, -1], [2, -1]]]).to(DEVICE)
    layout = group_layout(groups, group_bits(groups), block=4, num_groups=3)
    # sequence 0: group 0 holds tokens 1, 3, 4 (+1 padding), group 1 tokens 0, 1, 2, 4, group 2 nobody;
    # sequence 1: group 0 holds token 2, group 1 nobody, group 2 tokens 0, 1, 3, 4 (two tiles)
    assert layout.slot_token.tolist() == [1, 3, 4, -1, 0, 1, 2, 4, 2, -1, -1, -1, 0, 1, 3, 4]
    # the copies of tokens 1 and 4 of sequence 0 in group 1 are extra (their group 0 is lower), numbered in the
    # order of the memberships of `groups`
    assert layout.slot_extra.tolist() == [-1] * 5 + [0, -1, 1] + [-1] * 8
    assert layout.num_extra == 2 and layout.extra_batch.tolist() == [0, 0] and layout.extra_token.tolist() == [1, 4]
    assert layout.tile_batch.tolist() == [0, 0, 1, 1] and layout.tile_lower.tolist() == [0, 1, 0, 3]
    assert layout.tile_seg_start.tolist() == [0, 4, 8, 12] and layout.tile_seg_end.tolist() == [4, 8, 12, 16]


def test_segment_bounds_carry_across_chunks():
    """The layout's one-program scan of the segments, in chunks of 32 over 100 segments (empty ones included):
    padded counts and both running ends as torch computes them."""
    from sieve_attn.ops.focus.layout import _segment_bounds
    counts = torch.randint(0, 9, (100,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    counts[::7] = 0
    counts = counts.to(DEVICE)
    bounds = torch.full((3, 100), -7, dtype=torch.int32, device=DEVICE)
    _segment_bounds[(1,)](counts, bounds, 100, 4, BLOCK=32)
    padded = (counts + 3) // 4 * 4
    assert torch.equal(bounds[0], padded)
    assert torch.equal(bounds[1], torch.cumsum(padded, 0, dtype=torch.int32))
    assert torch.equal(bounds[2], torch.cumsum(counts, 0, dtype=torch.int32))


@pytest.mark.parametrize("slots", [1, 2])
def test_group_layout_is_the_same_with_int64_sort_keys(slots, monkeypatch):
    """Sort keys are int32 where they fit (layout.sort_key_dtype) and int64 past 2**31; both give the same layout."""
    from sieve_attn.ops.focus import layout as layout_module
    gen = torch.Generator().manual_seed(slots)
    groups = torch.stack([torch.randperm(5, generator=gen)[:slots] for _ in range(2 * 37)]).view(2, 37, slots)
    if slots == 2:
        groups[:, ::3, 1] = -1
    groups = groups.to(DEVICE)
    narrow = group_layout(groups, group_bits(groups), block=8, num_groups=5)
    monkeypatch.setattr(layout_module, "sort_key_dtype", lambda largest: torch.int64)
    wide = layout_module.group_layout(groups, group_bits(groups), block=8, num_groups=5)
    for name in ("slot_token", "slot_extra", "tile_batch", "tile_lower", "tile_seg_start", "tile_seg_end",
                 "extra_batch", "extra_token"):
        assert torch.equal(getattr(narrow, name), getattr(wide, name)), name
    assert narrow.num_extra == wide.num_extra


def test_group_layout_with_one_group_per_token_bounds_the_slots_without_reading_the_device(monkeypatch):
    """m = 1: no extra copies, and the slot count is an upper bound (10 tokens + 6 segments x 3 padding slots = 28),
    so nothing is read back to the host; the tiles past the real slots are padding over empty segments."""
    groups = torch.tensor([[[1], [0], [1], [1], [0]], [[2], [2], [0], [2], [2]]]).to(DEVICE)
    bits = group_bits(groups)

    def no_host_read(*args, **kwargs):
        raise AssertionError("the layout read a device value on the host")

    with monkeypatch.context() as patch:
        for method in ("tolist", "item", "__int__", "__bool__"):
            patch.setattr(torch.Tensor, method, no_host_read)
        layout = group_layout(groups, bits, block=4, num_groups=3)
    # sequence 0: group 0 holds tokens 1, 4, group 1 tokens 0, 2, 3; sequence 1: group 0 token 2, group 2 the rest
    assert layout.slot_token.tolist() == [1, 4, -1, -1, 0, 2, 3, -1, 2, -1, -1, -1, 0, 1, 3, 4] + [-1] * 12
    assert layout.num_extra == 0 and layout.slot_extra.tolist() == [-1] * 28
    assert layout.tile_batch.tolist()[:4] == [0, 0, 1, 1] and layout.tile_lower.tolist()[:4] == [0, 1, 0, 3]
    assert layout.tile_seg_start.tolist() == [0, 4, 8, 12, 16, 20, 24]
    assert layout.tile_seg_end.tolist() == [4, 8, 12, 16, 16, 20, 24]


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA notion")
def test_prefill_with_one_group_per_token_never_waits_for_the_gpu():
    """The Triton forward and backward of top-1 groups validated beforehand (as a composed model's routing is),
    inside skip_nan_checks(): queued without one host synchronisation (torch's sync debug mode turns any into an
    error)."""
    from sieve_attn import skip_nan_checks
    from sieve_attn.ops.focus.groups import FocusGroups

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 700, 64, generator=gen).to(DEVICE, BF16).requires_grad_() for _ in range(3))
    ids = torch.randint(0, 5, (1, 700), generator=gen).to(DEVICE)
    groups = FocusGroups.of(ids, 1, 700, q.device)
    grad = torch.randn(q.shape, generator=gen).to(DEVICE, BF16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with skip_nan_checks():
            out = focus_attention(q, k, v, groups, window=16, backend="triton")
            out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = focus_attention(q.detach(), k.detach(), v.detach(), ids, window=16, backend="reference")
    torch.testing.assert_close(out.detach().float(), want.float(), rtol=0, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_tensors_on_another_gpu_than_the_current_one(backend):
    """Launches go to the tensors' device (cuda:1) while cuda:0 is current, forward and backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 64, generator=gen).to("cuda:1", BF16).requires_grad_() for _ in range(3))
    ids = torch.randint(0, 3, (1, 300), generator=gen).to("cuda:1")
    torch.cuda.set_device(0)
    out = focus_attention(q, k, v, ids, window=16, backend=backend)
    out.float().sum().backward()
    want = focus_attention(q.detach().float(), k.detach().float(), v.detach().float(), ids, window=16,
                           backend="reference")
    torch.testing.assert_close(out.detach().float(), want, rtol=0, atol=2e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_window_layout_pads_each_sequence():
    layout = window_layout(batch=2, length=10, block=4, device="cpu")
    assert layout.slot_token.tolist() == list(range(10)) + [-1, -1] + list(range(10)) + [-1, -1]
    assert layout.tile_batch.tolist() == [0, 0, 0, 1, 1, 1]
    assert layout.tile_seg_start.tolist() == [0, 0, 0, 12, 12, 12]
    assert layout.tile_seg_end.tolist() == [12] * 3 + [24] * 3


def test_explicit_triton_refuses_what_it_cannot_compute():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    groups = torch.zeros(1, 8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="backend: .*attn_mask"):
        focus_attention(q, q, q, groups, backend="triton", attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool,
                                                                                 device=DEVICE))
    with pytest.raises(ValueError, match="backend: .*head dims"):
        focus_attention(q[..., :12], q[..., :12], q[..., :12], groups, backend="triton")
    with pytest.raises(ValueError, match="backend: .*group ids < 63"):
        focus_attention(q, q, q, groups + 63, backend="triton")
    with pytest.raises(ValueError, match="softcap: expected None with backend='dense'"):
        focus_attention(q, q, q, groups, backend="dense", softcap=3.0)


def test_auto_takes_the_batched_group_call_for_long_groups_on_cuda():
    """A CUDA stand-in (the dispatch reads shapes, devices and dtypes only): causal calls with one or two groups per
    token go to the decomposition from SDPA_FROM's tokens per group and tokens, which differ with and without
    gradients; shorter groups or sequences, three groups per token, non-causal calls and softcap stay with the
    Triton kernels."""
    def stand_in(length):
        return SimpleNamespace(shape=(1, 8, length, 128), device=torch.device("cuda"), dtype=torch.bfloat16)

    def pick(length, num_groups=8, memberships=1, causal=True, softcap=None, needs_grad=False):
        return attention._resolve(stand_in(length), stand_in(length), num_groups, memberships, causal=causal,
                                  softcap=softcap, attn_mask=None, backend="auto", return_lse=False,
                                  needs_grad=needs_grad)

    for memberships in (1, 2):
        for needs_grad in (False, True):
            per_group, tokens = attention.SDPA_FROM[(memberships, needs_grad)]
            groups = max(8, tokens // per_group)  # the shortest such sequence of at least 8 groups
            length = per_group * groups
            name, why = pick(length, groups, memberships, needs_grad=needs_grad)
            assert name == "sdpa" and "SDPA_FROM" in why, (memberships, needs_grad, why)
            assert ("inclusion-exclusion" in why) == (memberships == 2)
            # one token short in each group, then long groups in too short a sequence
            assert pick(length - groups, groups, memberships, needs_grad=needs_grad)[0] == "triton"
            if length == tokens:
                assert pick(length // 2, groups // 2, memberships, needs_grad=needs_grad)[0] == "triton"
    long = attention.SDPA_FROM[(1, False)][1]
    assert pick(long, memberships=3)[0] == "triton"
    assert pick(long, causal=False)[0] == "triton"
    assert pick(long, softcap=30.0)[0] == "triton"
    # v14's measured case: 4K tokens per group in 32K tokens takes the Triton kernels forward, cuDNN for training
    assert pick(32768)[0] == "triton" and pick(32768, needs_grad=True)[0] == "sdpa"


def test_auto_says_what_it_picks():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    groups = torch.zeros(1, 8, dtype=torch.long, device=DEVICE)
    name, why = focus_backend(q, q, groups)
    if DEVICE == "cpu":
        assert name == "reference" and "CUDA" in why
    else:
        assert name == "dense" and "DENSE_BELOW" in why
    assert focus_backend(q, q, groups, backend="reference") == ("reference", "requested")
