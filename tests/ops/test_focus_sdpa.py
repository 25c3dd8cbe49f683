"""Decomposition backend of hard Focus attention (backend="sdpa") against the fp64 reference; and the helpers every
fast Focus backend's tests share (tests/ops/test_focus_triton.py imports them).

Rule (FlashAttention's): the backend's error against fp64 is at most twice the error of PyTorch's own attention in
the same dtype (SDPA with the pattern as a mask, ``backend="dense"``) against fp64, for the output and for dq, dk, dv.
On the CPU the fused calls are ``_scaled_dot_product_flash_attention_for_cpu``; on a GPU the same tests run the CUDA
families (cuDNN, flash, memory-efficient), and the family tests below force each one in turn.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import sieve_attn.ops.focus.decomposed as decomposed
from sieve_attn.ops import gather, merge
from sieve_attn.ops.focus import sdpa_ops, segments
from sieve_attn.ops.focus.attention import focus_attention, focus_backend
from sieve_attn.ops.focus.decomposed import SortedGroups

try:
    from tests.backends import runs_backend
except ImportError:  # pytest imported the test modules with tests/ on the path
    from backends import runs_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16 = torch.float32, torch.bfloat16
# Absolute floor of the bound: float32 SDPA can be within 1e-7 of fp64, closer than any other summation order.
FLOOR = {F32: 2e-6, BF16: 1e-3}


# ---------------------------------------------------------------------------------------------------- shared helpers

def make_groups(batch, length, num_groups, slots, seed, spread=1, offset=0, sink=True):
    """[B, T, slots] distinct random ids; with 2 slots every third token leaves its second slot empty (-1), and
    (with ``sink``, then [B, T, num_groups]) the first token joins every group. Real ids become id * spread + offset
    (spread > 1 leaves groups empty, an offset past 62 makes the ids too large for bit sets)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_groups, generator=gen)[:slots] for _ in range(batch * length)])
    ids = ids.view(batch, length, slots)
    if slots > 1:
        ids[:, ::3, 1] = -1
    if slots > 1 and sink:
        every = torch.arange(num_groups).expand(batch, 1, num_groups)
        ids = torch.cat([ids, ids.new_full((batch, length, num_groups - slots), -1)], dim=-1)
        ids[:, :1] = every
    ids = torch.where(ids >= 0, ids * spread + offset, ids)
    return ids.to(DEVICE)


def run_backend(q, k, v, groups, backend, grads=True, **kw):
    """[out, dq, dk, dv] of focus_attention with ``backend``, for a fixed output gradient ([out] without ``grads``,
    computed under no_grad)."""
    if not grads:
        with torch.no_grad():
            return [focus_attention(q, k, v, groups, backend=backend, **kw)]
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = focus_attention(q, k, v, groups, backend=backend, **kw)
    grad = torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape).to(out.dtype)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def check_against_reference(case: str, spec: tuple, backend: str, spread: int = 1, offset: int = 0,
                            grads: bool = True, sink: bool = True, seed: Optional[int] = None) -> None:
    """Runs ``spec`` = (batch, q_heads, kv_heads, length, head_dim, num_groups, slots, window, causal, softcap,
    dtype) with ``backend`` on random inputs and groups of ``seed`` (default: the case name's length); out, dq, dk,
    dv (out alone without ``grads``) must meet FlashAttention's rule against the fp64 reference."""
    batch, hq, hkv, length, dim, num_groups, slots, window, causal, softcap, dtype = spec
    seed = len(case) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, length, dim, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    groups = make_groups(batch, length, num_groups, slots, seed=seed, spread=spread, offset=offset, sink=sink)
    kw = dict(window=window, causal=causal, softcap=softcap, grads=grads)
    exact = run_backend(q.double(), k.double(), v.double(), groups, "reference", **kw)
    with runs_backend("focus", backend):
        fast = run_backend(q.to(dtype), k.to(dtype), v.to(dtype), groups, backend, **kw)
    # PyTorch's own low-precision attention: SDPA with the pattern mask (it has no softcap: then the reference).
    baseline = run_backend(q.to(dtype), k.to(dtype), v.to(dtype), groups, "reference" if softcap else "dense", **kw)
    for name, got, ref, base in zip(("out", "dq", "dk", "dv"), fast, exact, baseline):
        assert not torch.isnan(got).any(), name
        err = (got.double() - ref).abs().max().item()
        bound = 2 * (base.double() - ref).abs().max().item() + FLOOR[dtype]
        assert err <= bound, f"{case} {name}: error {err:.3g} > bound {bound:.3g}"


def check_lse_and_out(backend: str) -> None:
    """lse against the fp64 reference's, and ``out`` (poisoned with NaN) written in place and returned."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=gen).to(DEVICE) for _ in range(3))
    groups = make_groups(1, 50, 4, 2, seed=3)
    ref, ref_lse = focus_attention(q.double(), k.double(), v.double(), groups, window=4, backend="reference",
                                   return_lse=True)
    out = torch.full_like(q, float("nan"))
    with runs_backend("focus", backend):
        got, lse = focus_attention(q, k, v, groups, window=4, backend=backend, return_lse=True, out=out)
    assert got.data_ptr() == out.data_ptr() and lse.dtype == torch.float32
    assert (got.double() - ref).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------------- sdpa backend

# (batch, q_heads, kv_heads, length, head_dim, num_groups, slots, window, causal, softcap, dtype); odd lengths
CASES = {
    "mha-top1": (1, 2, 2, 63, 16, 3, 1, 5, True, None, F32),
    "gqa-top2-sink": (2, 4, 2, 70, 32, 4, 2, 7, True, None, F32),
    "mqa-top2-noncausal": (1, 3, 1, 45, 16, 5, 2, 3, False, None, F32),
    "one-group-window-past-end": (1, 2, 2, 40, 16, 1, 1, 100, True, None, F32),
    "gqa-top1-noncausal-empty-groups": (2, 4, 2, 57, 16, 4, 1, 6, False, None, F32),
    "top3-noncausal-ids-past-63": (1, 2, 1, 50, 16, 4, 3, 11, False, None, F32),
    "long-groups-bf16": (1, 2, 1, 150, 16, 2, 1, 40, True, None, BF16),
    "window0-bf16-top2": (1, 2, 2, 97, 64, 3, 2, 0, True, None, BF16),
    "mqa-top1-ids-past-63-bf16": (1, 4, 1, 77, 32, 5, 1, 9, True, None, BF16),
    "gqa-top1-bf16": (1, 6, 2, 70, 32, 4, 1, 7, True, None, BF16),
    "gqa-top1-ids-past-31-bf16": (1, 6, 2, 70, 32, 4, 1, 7, True, None, BF16),
    # at most two groups per token, causal: inclusion-exclusion (the pairs of tokens in the same two groups taken
    # away); two groups only: every two-group token is in one class, the worst case of its rounding
    "gqa-top2-pairs-bf16": (2, 4, 2, 97, 32, 8, 2, 7, True, None, BF16),
    "mqa-top2-pairs-three-groups": (1, 3, 1, 64, 16, 3, 2, 5, True, None, F32),
    "top2-pairs-window0-bf16": (1, 2, 2, 61, 64, 4, 2, 0, True, None, BF16),
    "top2-one-pair-class-bf16": (1, 2, 1, 80, 32, 2, 2, 6, True, None, BF16),
}
# No sink token in every group: at most two memberships per token
NO_SINK = {"gqa-top2-pairs-bf16", "mqa-top2-pairs-three-groups", "top2-pairs-window0-bf16", "top2-one-pair-class-bf16"}
# Group ids id * spread + offset: every third group empty; ids past 62 (no bit sets, the id-list path)
SPREAD = {"gqa-top1-noncausal-empty-groups": 3}
# ids 32..35: 64-bit bit sets in the Triton kernels (ids < 31 take 32 bits)
OFFSET = {"top3-noncausal-ids-past-63": 60, "mqa-top1-ids-past-63-bf16": 70, "gqa-top1-ids-past-31-bf16": 32}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_forward_and_backward(case):
    check_against_reference(case, CASES[case], "sdpa", SPREAD.get(case, 1), OFFSET.get(case, 0),
                            sink=case not in NO_SINK)


@pytest.mark.parametrize("case", sorted(NO_SINK))
def test_two_groups_per_token_take_inclusion_exclusion_without_masks(case, monkeypatch):
    """The group set of at most two memberships per token, causal, is two causal calls: no masked call runs in
    the forward (the window set's, without the window kernel, excepted), and the pairs' layout holds the
    two-group tokens."""
    plans, window_calls = [], []

    def no_masked_group_call(*args):
        raise AssertionError("a masked same-group call ran")

    real_init, real_window = decomposed._Plan.__init__, decomposed._Plan._window_forward

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        plans.append(self)

    def window_forward(self, *args):
        window_calls.append(1)
        return real_window(self, *args)

    monkeypatch.setattr(decomposed._Plan, "__init__", init)
    monkeypatch.setattr(decomposed._Plan, "_window_forward", window_forward)
    monkeypatch.setattr(decomposed._Plan, "_group_calls", no_masked_group_call)
    batch, hq, hkv, length, dim, num_groups, slots, window, causal, _, dtype = CASES[case]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, length, dim, generator=gen).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    groups = make_groups(batch, length, num_groups, slots, seed=1, sink=False)
    with torch.no_grad():
        focus_attention(q, k, v, groups, window=window, backend="sdpa")
    (plan,) = plans
    two = (groups >= 0).all(-1).flatten()
    assert plan.subtracts and plan.pairs.member_token.sort().values.tolist() == two.nonzero().flatten().tolist()
    assert len(window_calls) == (window > 0 and plan.window_kernel is None)  # the masked window calls


@pytest.mark.parametrize("num_groups, seed", [(2, 7), (2, 35), (16, 33)])
def test_gradients_summed_over_calls_keep_the_rule(num_groups, seed):
    """Random bf16 top-2 inputs (no sink) whose gradients broke the rule on the CPU while each masked call's share
    came back rounded to bf16 before the shares of a token were summed: dq 1.06x, dv 1.09x, dq 1.08x the bound
    (seeds of a 200-case sweep). The shares now come in float32."""
    check_against_reference(f"sweep-{seed}", (2, 4, 2, 97, 32, num_groups, 2, 7, True, None, BF16), "sdpa",
                            sink=False, seed=seed)


@pytest.mark.parametrize("slots", [1, 2])
def test_float64_keeps_float64_log_sum_exp_and_gradients(slots):
    """float64 inputs (the reference's precision) keep float64 through the plan, with one membership per token as
    with two: the output, and the gradients, which are computed from the plan's own log-sum-exp (the one returned is
    float32, as documented). A float32 log-sum-exp inside would put the gradients about 1e-6 off."""
    if DEVICE != "cpu":
        pytest.skip("float64 runs the reference on CUDA (the fused kernels take 16- and 32-bit inputs)")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    groups = make_groups(2, 37, 3, slots, seed=1, sink=False)
    out, lse = focus_attention(q, k, v, groups, window=5, backend="sdpa", return_lse=True)
    ref_out, ref_lse = focus_attention(q, k, v, groups, window=5, backend="reference", return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-5
    got, want = run_backend(q, k, v, groups, "sdpa", window=5), run_backend(q, k, v, groups, "reference", window=5)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64 and (a - b).abs().max() < 1e-12


def test_half_copies_are_exact_and_in_range():
    """bfloat16 q, k, v scaled by powers of two into float16 as they are packed: every value down to 2^-28 of its
    tensor's largest comes back exactly, the largest lies in [2^13, 2^14), the logit scale compensates, a zero
    tensor stays."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 3, 40, 16, generator=gen) * 3e3).to(DEVICE, torch.bfloat16)
    k = (torch.randn(2, 1, 40, 16, generator=gen) * torch.logspace(-9, 0, 16)).to(DEVICE, torch.bfloat16)
    v = torch.zeros(2, 1, 40, 16, dtype=torch.bfloat16, device=DEVICE)
    calls = decomposed.CallInputs.queue_half_copies(q, k, v, 0.25)()
    layout = SortedGroups.of(make_groups(2, 40, 3, 2, seed=0, sink=False), num_groups=3)
    copies = calls.pack(layout, q, k, v)
    for original, copy, factor in zip((q, k, v), copies, calls.factors):
        assert copy.dtype == torch.float16
        back = copy.double() / factor
        plain = layout.pack(original).double()
        big = plain.abs() >= original.double().abs().max() * 2.0 ** -28
        assert torch.equal(back[big], plain[big])
    for copy in copies[:2]:
        assert 2 ** 13 <= copy.abs().max().item() < 2 ** 14
    assert calls.factors[2] == 1.0 and calls.value_unit == 1.0
    assert calls.scale == 0.25 / (calls.factors[0] * calls.factors[1])


@pytest.mark.parametrize("case", ["gqa-top2-sink", "mqa-top2-noncausal", "long-groups-bf16",
                                  "gqa-top1-noncausal-empty-groups"])
def test_many_small_calls_match_reference(case, monkeypatch):
    # Blocks of 8 positions and masks of a few hundred pairs: several window blocks per call, several calls per
    # set, windows wider than a block, and chunks of query slots in the masked same-group calls.
    monkeypatch.setattr(decomposed, "MIN_BLOCK", 8)
    monkeypatch.setattr(decomposed, "MASK_ELEMENTS", 700)
    check_against_reference(case, CASES[case], "sdpa", SPREAD.get(case, 1), OFFSET.get(case, 0))


WINDOW_KERNEL_CASES = ["mha-top1", "gqa-top2-sink", "mqa-top2-noncausal", "long-groups-bf16",
                       "gqa-top1-noncausal-empty-groups", "gqa-top1-bf16", "one-group-window-past-end",
                       "gqa-top1-ids-past-31-bf16", "mqa-top2-pairs-three-groups", "top2-one-pair-class-bf16"]


@pytest.mark.parametrize("case", WINDOW_KERNEL_CASES)
def test_window_kernel_in_the_decomposition_matches_reference(case, monkeypatch):
    # On CUDA the window set runs as the Triton window kernel, the layouts are gathered by the Triton gather kernel
    # and the partials merge by the Triton merge kernel (CASES above take all three there); here the interpreter
    # runs them.
    pytest.importorskip("triton")
    merges = []

    def merge_kernel(*args, **options):
        merges.append(options)
        return merge.merge_indexed_triton(*args, **options)

    monkeypatch.setattr(decomposed, "window_kernel_serves", lambda q, groups: groups.bits is not None)
    monkeypatch.setattr(decomposed, "gather_rows", gather.gather_rows_triton)  # the packing CUDA runs, too
    monkeypatch.setattr(decomposed, "merge_indexed", merge_kernel)
    monkeypatch.setattr(segments, "serves", lambda ids: ids.numel() > 0)  # the layout's kernels
    check_against_reference(case, CASES[case], "sdpa", SPREAD.get(case, 1), OFFSET.get(case, 0),
                            sink=case not in NO_SINK)
    # the one sdpa run merges its partials by one kernel, whatever the memberships; inclusion-exclusion's pair
    # partials enter it subtracted
    assert len(merges) == 1 and (merges[0].get("subtracted") is not None) == (case in NO_SINK)


def test_window_kernel_writes_a_contiguous_output_for_a_strided_q(monkeypatch):
    """q whose last dimension is not contiguous (a transposed view): the output buffer the kernel writes is
    contiguous whatever q's strides, and the result equals the reference."""
    pytest.importorskip("triton")
    monkeypatch.setattr(decomposed, "window_kernel_serves", lambda q, groups: groups.bits is not None)
    monkeypatch.setattr(decomposed, "gather_rows", gather.gather_rows_triton)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 45, generator=gen).to(DEVICE).transpose(2, 3)  # [2, 4, 45, 32], stride(-1) = 45
    k, v = (torch.randn(2, 2, 45, 32, generator=gen).to(DEVICE) for _ in range(2))
    groups = make_groups(2, 45, 3, 1, seed=4)
    got = focus_attention(q, k, v, groups, window=6, backend="sdpa")
    want = focus_attention(q.double(), k.double(), v.double(), groups, window=6, backend="reference")
    assert (got.double() - want).abs().max() < 1e-5


def test_returns_lse_of_the_reference_and_writes_out():
    check_lse_and_out("sdpa")


def test_sorted_groups_pack_segments_in_position_order():
    groups = torch.tensor([[[1, -1], [0, 1], [1, -1], [0, -1], [1, 0]],
                           [[2, -1], [2, -1], [0, -1], [2, -1], [2, -1]]])
    layout = SortedGroups.of(groups, num_groups=3)
    # segments: (seq 0, group 0) = tokens 1, 3, 4; (0, 1) = 0, 1, 2, 4; (1, 0) = 2; (1, 2) = 0, 1, 3, 4; the empty
    # (0, 2) and (1, 1) have none. L = 4: the first and third segments are padded at their end.
    assert layout.counts.tolist() == [3, 4, 1, 4] and layout.segment_group.tolist() == [0, 1, 0, 2]
    assert layout.length == 4 and layout.multi
    assert layout.slot_tokens().tolist() == [[1, 3, 4, -1], [0, 1, 2, 4], [7, -1, -1, -1], [5, 6, 8, 9]]
    assert layout.token_slot is None  # several memberships: tokens are summed over their copies
    # slot of each (token, id slot), -1 for an empty id slot
    assert layout.entry_slots().tolist() == [[4, -1], [0, 5], [6, -1], [1, -1], [7, 2],
                                             [12, -1], [13, -1], [8, -1], [14, -1], [15, -1]]
    x = torch.arange(10.0).view(2, 1, 5)  # [B, H, T]: the value is the flat token index
    packed = layout.pack(x)
    assert packed.shape == (4, 1, 4) and packed[:, 0].tolist() == [[1, 3, 4, 0], [0, 1, 2, 4], [7, 0, 0, 0],
                                                                   [5, 6, 8, 9]]
    # the rows of the memberships, summed per token, count tokens 1 and 4 of sequence 0 twice
    assert layout.to_tokens(packed)[:, 0].tolist() == [[0, 2, 2, 3, 8], [5, 6, 7, 8, 9]]


@pytest.mark.parametrize("slots", [1, 2])
def test_sorted_groups_read_the_device_once_per_membership_kind(slots, monkeypatch):
    """One host read whatever the slots (the longest group, the segment count and the membership count together):
    empty slots sort past the memberships rather than being found by nonzero. Each read stalls the queue before
    the packing's launches."""
    groups = make_groups(2, 40, 5, slots, seed=2, spread=2)  # every other group empty
    reads = []
    for method in ("tolist", "item", "__int__", "__bool__", "nonzero"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _f=original, _m=method, **kw: reads.append(_m)
                            or _f(self, *a, **kw))
    original_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: reads.append("nonzero") or original_nonzero(*a, **kw))
    layout = SortedGroups.of(groups, num_groups=10)
    monkeypatch.undo()
    assert reads == ["tolist"]
    assert layout.num_segments == int((layout.counts > 0).sum()) and layout.counts.sum() == (groups >= 0).sum()


@pytest.mark.parametrize("slots", [1, 2])
def test_sorted_groups_of_no_tokens_have_no_segments(slots):
    layout = SortedGroups.of(torch.zeros(1, 0, slots, dtype=torch.long, device=DEVICE), num_groups=1)
    assert layout.num_segments == 0 and layout.length == 0 and layout.entry_slots().shape == (0, slots)


def test_sorted_groups_take_memory_of_the_memberships_not_of_the_ids():
    """Ids are unbounded above (validation only asks >= 0): ids near 10**12 must not size any buffer (a table per
    (sequence, group) would ask terabytes), and the decomposition still equals the reference."""
    ids = torch.tensor([[0, 10 ** 12, 0, 5, 10 ** 12, 5, 0, 5]], device=DEVICE)
    layout = SortedGroups.of(ids[..., None], num_groups=10 ** 12 + 1)
    assert layout.counts.tolist() == [3, 3, 2] and layout.segment_group.tolist() == [0, 5, 10 ** 12]
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    got = focus_attention(q, q, q, ids, window=1, backend="sdpa")
    want = focus_attention(q.double(), q.double(), q.double(), ids, window=1, backend="reference")
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("batch, length, num_groups, slots", [
    (2, 37, 5, 1),      # one block of entries
    (2, 700, 5, 2),     # several blocks, runs across their edges, empty id slots
    (1, 3000, 8, 1),
    (3, 500, 63, 2),    # the most groups bit sets hold
])
def test_sorted_groups_of_the_kernels_equal_pytorchs(batch, length, num_groups, slots):
    """The Triton build of the layout (CUDA's; the interpreter here) gives every field of the PyTorch build, for
    the groups and, with two slots, for the pairs of groups (a token in one group has no pair: partial)."""
    pytest.importorskip("triton")
    ids = make_groups(batch, length, num_groups, slots, seed=length, sink=False)
    cases = [(ids, num_groups, False)]
    if slots == 2:
        cases.append((decomposed._pair_classes(ids, num_groups), num_groups ** 2, True))
    for case_ids, case_groups, partial in cases:
        want = SortedGroups.start(case_ids.cpu(), case_groups, partial).finish()  # CPU ids: PyTorch's build
        got = segments.start(case_ids, case_groups, partial, decomposed._read_later).finish()
        for field in ("member_token", "member_entry", "counts", "segment_group", "slot_token", "member_slot",
                      "entry_slot"):
            assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), field
        assert (got.length, got.one_each, got.num_segments) == (want.length, want.one_each, want.num_segments)


def test_sorted_groups_of_the_kernels_take_memory_of_the_memberships_not_of_the_ids():
    pytest.importorskip("triton")
    ids = torch.tensor([[0, 10 ** 12, 0, 5, 10 ** 12, 5, 0, 5]], device=DEVICE)[..., None]
    layout = segments.start(ids, 10 ** 12 + 1, False, decomposed._read_later).finish()
    assert layout.counts.tolist() == [3, 3, 2] and layout.segment_group.tolist() == [0, 5, 10 ** 12]
    assert layout.slot_tokens().tolist() == [[0, 2, 6], [3, 5, 7], [1, 4, -1]]


def test_sorted_groups_with_one_group_per_token_map_tokens_to_slots_both_ways():
    groups = torch.tensor([[[1], [0], [1], [1], [0]], [[2], [2], [0], [2], [2]]])
    layout = SortedGroups.of(groups, num_groups=3)
    assert not layout.multi and layout.length == 4
    assert layout.slot_tokens().tolist() == [[1, 4, -1, -1], [0, 2, 3, -1], [7, -1, -1, -1], [5, 6, 8, 9]]
    assert layout.token_slot.tolist() == [4, 0, 5, 6, 1, 12, 13, 8, 14, 15]
    x = torch.randn(2, 3, 5, 8)  # [B, H, T, D]
    packed = layout.pack(x)
    assert packed.shape == (4, 3, 4, 8) and torch.equal(packed[0, :, 2:], torch.zeros(3, 2, 8))
    assert torch.equal(layout.to_tokens(packed), x) and torch.equal(layout.rows(packed)[0], x[0, :, 1])


def test_explicit_sdpa_refuses_what_it_cannot_compute():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    groups = torch.zeros(1, 8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="backend: .*takes no attn_mask"):
        focus_attention(q, q, q, groups, backend="sdpa",
                        attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="backend: .*takes no softcap"):
        focus_attention(q, q, q, groups, backend="sdpa", softcap=3.0)
    with pytest.raises(ValueError, match="backend: .*Tq == Tk"):
        focus_attention(q[:, :, :3], q, q, groups, backend="sdpa")
    assert focus_backend(q, q, groups, backend="sdpa") == ("sdpa", "requested")
    assert focus_backend(q, q, groups)[0] != "sdpa"  # 8 tokens: short groups, and dense below DENSE_BELOW on CUDA


# ---------------------------------------------------------------------------------------------------- op families

# Argument names, in order, of the private ops as sdpa_ops calls them (positionally up to the '*').
SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu":
        "query key value dropout_p is_causal attn_mask scale",
    "_scaled_dot_product_flash_attention_for_cpu_backward":
        "grad_out query key value out logsumexp dropout_p is_causal attn_mask scale",
    "_scaled_dot_product_cudnn_attention":
        "query key value attn_bias compute_log_sumexp dropout_p is_causal return_debug_mask scale",
    "_scaled_dot_product_cudnn_attention_backward":
        "grad_out query key value out logsumexp philox_seed philox_offset attn_bias cum_seq_q cum_seq_k max_q max_k "
        "dropout_p is_causal scale",
    "_scaled_dot_product_flash_attention":
        "query key value dropout_p is_causal return_debug_mask scale",
    "_scaled_dot_product_flash_attention_backward":
        "grad_out query key value out logsumexp cum_seq_q cum_seq_k max_q max_k dropout_p is_causal philox_seed "
        "philox_offset scale",
    "_scaled_dot_product_efficient_attention":
        "query key value attn_bias compute_log_sumexp dropout_p is_causal scale",
    "_scaled_dot_product_efficient_attention_backward":
        "grad_out_ query key value attn_bias out logsumexp philox_seed philox_offset dropout_p grad_input_mask "
        "is_causal scale",
}


@pytest.mark.parametrize("op", SCHEMAS)
def test_private_ops_take_the_arguments_we_pass(op):
    schema = getattr(torch.ops.aten, op).default._schema
    assert " ".join(argument.name for argument in schema.arguments) == SCHEMAS[op]


class _RecordedAten:
    """torch.ops.aten whose calls are recorded, each as (op name, {argument name: value}) by the op's schema, then
    run."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            names = [argument.name for argument in op.default._schema.arguments]
            self.calls.append((name, {**dict(zip(names, args)), **kwargs}))
            return op(*args, **kwargs)
        return call


@pytest.mark.parametrize("name, masked", [("cudnn", False), ("flash", False), ("efficient", False),
                                          ("efficient", True)])
def test_cuda_families_plumb_gqa_shapes(name, masked, monkeypatch):
    # Meta tensors run the ops' shape functions: argument order, the lse layouts and the per-head-group loop of the
    # memory-efficient kernel are checked without a GPU (numbers are checked by the GPU tests below), and every call
    # is recorded: causal unless a mask is passed, no dropout, the scale given.
    aten = _RecordedAten()
    monkeypatch.setattr(sdpa_ops, "_ATEN", aten)
    family = sdpa_ops.FAMILIES[name]
    q = torch.empty(3, 4, 10, 16, device="meta", dtype=BF16)
    k, v = (torch.empty(3, 2, 10, 16, device="meta", dtype=BF16) for _ in range(2))
    allowed = torch.ones(3, 1, 10, 10, dtype=torch.bool, device="meta") if masked else None
    out, lse, saved = family.forward(q, k, v, allowed, 0.25)
    assert out.shape == (3, 4, 10, 16) and lse.shape == (3, 4, 10)
    dq, dk, dv = family.backward(out, q, k, v, out, lse.float(), allowed, saved, 0.25)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    kernels = [(op, args) for op, args in aten.calls if op.startswith("_scaled_dot_product")]
    assert {op.endswith("_backward") for op, _ in kernels} == {False, True}
    for op, args in kernels:
        assert args["is_causal"] is not masked and args["dropout_p"] == 0.0 and args["scale"] == 0.25, (op, args)
        assert (args.get("attn_bias") is not None) == masked, op


def test_memory_efficient_calls_pair_each_query_head_with_its_kv_head():
    """GQA 6/2: query heads 0-2 read KV head 0 and heads 3-5 KV head 1 (views, no copies)."""
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    views = list(sdpa_ops._head_views(q, k, v))
    assert len(views) == 6
    for h, (q_h, k_h, v_h) in enumerate(views):
        assert q_h.shape == (2, 1, 5, 8) and k_h.shape == v_h.shape == (2, 1, 7, 8)
        assert q_h.data_ptr() == q[:, h].data_ptr()
        assert k_h.data_ptr() == k[:, h // 3].data_ptr() and v_h.data_ptr() == v[:, h // 3].data_ptr()


needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA op families need a GPU")


@needs_cuda
@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("case", ["mha-top1", "long-groups-bf16", "mqa-top1-ids-past-63-bf16", "gqa-top1-bf16"])
def test_each_cuda_causal_family_matches_reference(name, case, monkeypatch):
    spec = CASES[case][:-1] + (BF16,)  # cuDNN and flash take 16-bit inputs only
    monkeypatch.setattr(decomposed, "causal_call", _only_family(sdpa_ops.FAMILIES[name]))
    check_against_reference(case, spec, "sdpa", SPREAD.get(case, 1), OFFSET.get(case, 0))


def _only_family(family):
    def call(q, k, v, scale):
        return (family, *family.forward(q, k, v, None, scale))
    return call
