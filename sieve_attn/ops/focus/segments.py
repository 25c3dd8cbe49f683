"""The sorted-group layout of the decomposition (:class:`.decomposed.SortedGroups`) built by a few Triton kernels.

The same layout as the PyTorch build in :meth:`.decomposed.SortedGroups.start` (its reference), from the same
sort: the N entries of the ids get the keys (sequence, group, position), one radix sort orders them, and the runs of
equal (sequence, group) are the segments. PyTorch finds the runs with about thirty elementwise, scan, search and
scatter launches over the N entries; here five small kernels do it before the one read of the sizes and one after
it. On the H200 at 64K tokens (K = 8; v19 in benchmarks/results/focus_h200/NOTES.md) a forward's layout kernels
took 0.08 ms instead of 0.135 with one group per token, and 0.19 ms instead of 0.32 for the two layouts of two
groups each; its launches fell from 52 to 25 and from 133 to 56. Side by side (three runs each, the bench's
queued calls) the forward took 2.441-2.528 ms against 2.512-2.523 (top-1) and 8.879-9.545 against 9.353-9.824
(top-2): a gain of about 0.07 and 0.2 ms, inside the spread of the power-capped cuDNN calls.

1. ``_entry_keys``: each entry's sort key; empty slots (-1) get a key past every membership's.
2. ``_count_runs``: per block of sorted entries, how many runs start in it and how many entries are memberships.
3. ``_run_offsets`` (one program): the blocks' first run numbers (an exclusive scan), the number of segments S
   and of memberships E.
4. ``_run_starts``: each run's first entry and group; ``_longest_run``: the largest member count L.
5. after the read of (L, S, E): ``_place_entries``: each membership's slot s * L + r, the token in each slot, the
   slot of each entry of the ids.

Memory is O(N) whatever the ids (no table per possible (sequence, group)), as in the PyTorch build.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..triton_common import jit, on_device_of, triton
from .layout import sort_key_dtype

if triton is not None:
    import triton.language as tl

# Entries per program of the elementwise kernels, and blocks per step of the one-program scan.
_BLOCK = 1024
_SCAN_CHUNK = 1024


def serves(ids: torch.Tensor) -> bool:
    """Whether the kernels build this layout: CUDA ids with at least one entry (the interpreter serves tests)."""
    return triton is not None and ids.is_cuda and ids.numel() > 0


@dataclass(frozen=True)
class KernelSortInFlight:
    """The device half of the layout before the read of its sizes: the sorted keys and their order, each block's
    first run number, each run's first entry (run S's: E) and group, and the sizes' read."""

    sorted_keys: torch.Tensor  # [N] int32 or int64
    order: torch.Tensor        # [N] int64: the entry of the ids at each sorted place
    block_runs: torch.Tensor   # [blocks] int64: runs starting before each block
    run_first: torch.Tensor    # [N + 1] int64
    run_group: torch.Tensor    # [N] int64
    past: int                  # the key of an empty slot
    sequences: int
    tokens: int
    id_slots: int
    num_groups: int
    one_each: bool             # every entry a membership
    sizes: Callable[[], list]  # () -> [longest, number of segments, number of memberships]

    def finish(self):
        """The :class:`.decomposed.SortedGroups`, after the read of the sizes."""
        from .decomposed import SortedGroups  # it imports this module

        longest, num_segments, count = self.sizes()
        entries = self.order.numel()
        device = self.order.device
        slot_token = torch.full((num_segments * longest,), -1, dtype=torch.long, device=device)
        entry_slot = torch.full((entries,), -1, dtype=torch.long, device=device)
        member_token, member_slot = torch.empty(2, count, dtype=torch.long, device=device)
        with on_device_of(self.order):
            _place_entries[(triton.cdiv(entries, _BLOCK),)](
                self.sorted_keys, self.order, self.block_runs, self.run_first, slot_token, entry_slot, member_token,
                member_slot, entries, self.tokens, self.past, self.num_groups, longest, BLOCK=_BLOCK)
        counts = self.run_first[1:num_segments + 1] - self.run_first[:num_segments]
        return SortedGroups(member_token, self.order[:count], counts, self.run_group[:num_segments], slot_token,
                            member_slot, entry_slot, self.one_each, self.sequences, self.tokens, self.id_slots,
                            length=longest)


def start(ids: torch.Tensor, num_groups: int, partial: bool, read_later) -> KernelSortInFlight:
    """:meth:`.decomposed.SortedGroups.start` by the kernels (``serves(ids)``): queues the sort, the runs and the
    read of the sizes (by ``read_later``, which queues a copy of a device tensor to the host and returns its
    reader)."""
    batch, length, slots = ids.shape
    entries = ids.numel()
    device = ids.device
    past = batch * num_groups * length
    blocks = triton.cdiv(entries, _BLOCK)
    keys = torch.empty(entries, dtype=sort_key_dtype(past), device=device)
    with on_device_of(ids):
        _entry_keys[(blocks,)](ids.contiguous(), keys, entries, length, slots, num_groups, past, BLOCK=_BLOCK)
        sorted_keys, order = torch.sort(keys)
        block_counts = torch.empty(2, blocks, dtype=torch.long, device=device)
        _count_runs[(blocks,)](sorted_keys, block_counts, entries, length, past, BLOCK=_BLOCK)
        block_runs = torch.empty(blocks, dtype=torch.long, device=device)
        run_first = torch.empty(entries + 1, dtype=torch.long, device=device)
        sizes = torch.empty(3, dtype=torch.long, device=device)
        _run_offsets[(1,)](block_counts, block_runs, run_first, sizes, blocks, CHUNK=_SCAN_CHUNK)
        run_group = torch.empty(entries, dtype=torch.long, device=device)
        _run_starts[(blocks,)](sorted_keys, block_runs, run_first, run_group, entries, length, past, num_groups,
                               BLOCK=_BLOCK)
        _longest_run[(blocks,)](run_first, sizes, BLOCK=_BLOCK)
    return KernelSortInFlight(sorted_keys, order, block_runs, run_first, run_group, past, batch, length, slots,
                              num_groups, one_each=slots == 1 and not partial, sizes=read_later(sizes))


@jit
def _entry_keys(IDS, KEYS, entries, length, slots, num_groups, past, BLOCK: tl.constexpr):
    """Entry e = (b * T + t) * m + j of the ids [B, T, m]: key (b * K + ids[e]) * T + t, ``past`` for -1."""
    e = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = e < entries
    group = tl.load(IDS + e, mask=live, other=-1).to(tl.int64)
    token = e // slots
    key = ((token // length) * num_groups + group) * length + token % length
    tl.store(KEYS + e, tl.where(group >= 0, key, past).to(KEYS.dtype.element_ty), mask=live)


@jit
def _runs_in_block(SORTED_KEYS, block, entries, length, past, BLOCK: tl.constexpr):
    """(i, key, real, new) of the block's sorted entries i: ``real`` for memberships (the first E entries), ``new``
    where a run of equal (sequence, group) starts."""
    i = (block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = i < entries
    key = tl.load(SORTED_KEYS + i, mask=live, other=past).to(tl.int64)
    before = tl.load(SORTED_KEYS + i - 1, mask=live & (i > 0), other=0).to(tl.int64)
    real = key < past
    new = real & ((i == 0) | (key // length != before // length))  # keys are >= 0: // is floor division
    return i, key, real, new


@jit
def _count_runs(SORTED_KEYS, BLOCK_COUNTS, entries, length, past, BLOCK: tl.constexpr):
    """BLOCK_COUNTS [2, blocks]: runs starting in each block, memberships in it."""
    block = tl.program_id(0)
    _, _, real, new = _runs_in_block(SORTED_KEYS, block, entries, length, past, BLOCK)
    tl.store(BLOCK_COUNTS + block, tl.sum(new.to(tl.int64), axis=0))
    tl.store(BLOCK_COUNTS + tl.num_programs(0) + block, tl.sum(real.to(tl.int64), axis=0))


@jit
def _run_offsets(BLOCK_COUNTS, BLOCK_RUNS, RUN_FIRST, SIZES, blocks, CHUNK: tl.constexpr):
    """One program: BLOCK_RUNS = the exclusive running sum of the runs starting in each block; SIZES = [0 (the
    longest run, for _longest_run's maxima), S runs, E memberships]; RUN_FIRST[S] = E."""
    runs = tl.full([], 0, tl.int64)
    members = tl.full([], 0, tl.int64)
    for first in range(0, blocks, CHUNK):
        b = first + tl.arange(0, CHUNK)
        live = b < blocks
        starting = tl.load(BLOCK_COUNTS + b, mask=live, other=0)
        tl.store(BLOCK_RUNS + b, runs + tl.cumsum(starting, axis=0) - starting, mask=live)
        runs += tl.sum(starting, axis=0)
        members += tl.sum(tl.load(BLOCK_COUNTS + blocks + b, mask=live, other=0), axis=0)
    tl.store(SIZES, 0)
    tl.store(SIZES + 1, runs)
    tl.store(SIZES + 2, members)
    tl.store(RUN_FIRST + runs, members)


@jit
def _run_number(BLOCK_RUNS, block, new):
    """The run of each entry of the block (the first run of the block plus the starts up to the entry, minus 1)."""
    return tl.load(BLOCK_RUNS + block) + tl.cumsum(new.to(tl.int64), axis=0) - 1


@jit
def _run_starts(SORTED_KEYS, BLOCK_RUNS, RUN_FIRST, RUN_GROUP, entries, length, past, num_groups,
                BLOCK: tl.constexpr):
    """RUN_FIRST[s] and RUN_GROUP[s]: the first sorted entry of run s and its group."""
    block = tl.program_id(0)
    i, key, _, new = _runs_in_block(SORTED_KEYS, block, entries, length, past, BLOCK)
    run = _run_number(BLOCK_RUNS, block, new)
    tl.store(RUN_FIRST + run, i, mask=new)
    tl.store(RUN_GROUP + run, key // length % num_groups, mask=new)


@jit
def _longest_run(RUN_FIRST, SIZES, BLOCK: tl.constexpr):
    """SIZES[0] = the largest member count of the S runs (RUN_FIRST[s + 1] - RUN_FIRST[s])."""
    s = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = s < tl.load(SIZES + 1)
    count = tl.load(RUN_FIRST + s + 1, mask=live, other=0) - tl.load(RUN_FIRST + s, mask=live, other=0)
    tl.atomic_max(SIZES, tl.max(count, axis=0))


@jit
def _place_entries(SORTED_KEYS, ORDER, BLOCK_RUNS, RUN_FIRST, SLOT_TOKEN, ENTRY_SLOT, MEMBER_TOKEN, MEMBER_SLOT,
                   entries, length, past, num_groups, longest, BLOCK: tl.constexpr):
    """Membership i (sorted order), of run s and rank r = i - RUN_FIRST[s]: slot s * L + r, token b * T + t;
    written to MEMBER_SLOT[i], MEMBER_TOKEN[i], SLOT_TOKEN[slot] and ENTRY_SLOT[ORDER[i]]."""
    block = tl.program_id(0)
    i, key, real, new = _runs_in_block(SORTED_KEYS, block, entries, length, past, BLOCK)
    run = _run_number(BLOCK_RUNS, block, new)
    slot = run * longest + i - tl.load(RUN_FIRST + run, mask=real, other=0)
    token = key // length // num_groups * length + key % length
    tl.store(MEMBER_SLOT + i, slot, mask=real)
    tl.store(MEMBER_TOKEN + i, token, mask=real)
    tl.store(SLOT_TOKEN + slot, token, mask=real)
    tl.store(ENTRY_SLOT + tl.load(ORDER + i, mask=real, other=0), slot, mask=real)
