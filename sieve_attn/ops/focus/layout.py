"""Tiled layouts of the two disjoint pair sets of the Focus pattern, as the fast kernels walk them.

The hard Focus pattern splits exactly into
- the **group set**: pairs whose tokens share a group, each counted in the lowest group they share (docs/decisions.md,
  decision 4), and
- the **window set**: pairs inside the local window, 0 <= i - j <= window, whose tokens share no group.

Both sets are walked over a *layout*: a 1-d sequence of slots, each holding a token index (or -1 for padding), cut
into tiles of ``block`` slots and grouped in segments (a sequence, or one group of one sequence). A tile is a block
of queries in the forward pass and a block of keys in the backward pass; the kernels derive the slot range each
tile reads from its segment bounds (the keys before a query in its segment, or ``window`` positions back).

- Group layout: every (batch, group) membership of every token, sorted by (batch, group, position), each
  group's segment padded to a multiple of ``block``. Inside a segment slots follow positions, so causality is
  "key slot <= query slot" and a group costs causal dense attention on its own members. A token with m memberships
  appears m times; its copy in its lowest group has rank 0, the others rank 1.. and a compact ``slot_extra`` index.
- Window layout: each sequence in position order, padded to a multiple of ``block``; a query tile reads the keys
  from ``window`` positions before it up to its own end.

Building the group layout costs one sort of the memberships, and with several memberships per token one host
synchronisation (the number of slots and of extra copies). With one membership per token there is none: the layout
takes an upper bound of the slot count, and tiles past the real slots hold only padding and read empty segments. The
window layout depends only on the shape and is cached.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..triton_common import jit, triton

if triton is not None:
    import triton.language as tl


@dataclass(frozen=True)
class TileLayout:
    """Slots and tiles of one pair set. Slot tensors are [P] int32, tile tensors [P // block] int32 (tile_lower in
    the dtype of the kernels' bit sets)."""

    block: int
    slot_token: torch.Tensor    # token position of each slot, -1 = padding
    slot_extra: torch.Tensor    # -1 for a token's rank-0 copy, else the copy's index in the extra-output buffers
    tile_batch: torch.Tensor    # sequence of each tile
    tile_lower: torch.Tensor    # bit set of the groups below the tile's group (0 in the window layout), the bits' dtype
    tile_seg_start: torch.Tensor  # first slot of the tile's segment
    tile_seg_end: torch.Tensor    # one past the last slot of the tile's segment (a multiple of block)
    num_extra: int              # copies of rank >= 1 (tokens with several memberships)
    extra_batch: Optional[torch.Tensor] = None  # [num_extra] sequence of each extra copy
    extra_token: Optional[torch.Tensor] = None  # [num_extra] token position of each extra copy

    @property
    def num_tiles(self) -> int:
        return self.tile_batch.numel()


def sort_key_dtype(largest: int) -> torch.dtype:
    """The narrowest of int32 and int64 that holds sort keys up to ``largest``: a GPU radix sort makes one pass per 8
    key bits, so int32 keys take half the passes of int64 ones."""
    return torch.int32 if largest < 2 ** 31 else torch.int64


def _int32(*tensors):
    return [t.to(torch.int32).contiguous() for t in tensors]


@functools.lru_cache(maxsize=16)
def window_layout(batch: int, length: int, block: int, device, lower_dtype: torch.dtype = torch.int64) -> TileLayout:
    """Layout of the window set: each of ``batch`` sequences of ``length`` tokens in order, padded to ``block``;
    ``tile_lower`` (zeros) comes in ``lower_dtype``. Cached: every layer of a model forward uses the same one."""
    tiles_per_seq = -(-length // block)
    padded = tiles_per_seq * block
    position = torch.arange(padded, device=device)
    slot_token = torch.where(position < length, position, -1).repeat(batch)
    tile_batch = torch.arange(batch, device=device).repeat_interleave(tiles_per_seq)
    seg_start = tile_batch * padded
    return TileLayout(block, *_int32(slot_token, torch.full_like(slot_token, -1), tile_batch),
                      torch.zeros_like(tile_batch, dtype=lower_dtype), *_int32(seg_start, seg_start + padded),
                      num_extra=0)


def group_layout(groups: torch.Tensor, bits: torch.Tensor, block: int, num_groups: int,
                 lower_dtype: torch.dtype = torch.int64) -> TileLayout:
    """Layout of the group set for memberships ``groups`` [B, T, m] (-1 = empty slot, ids < num_groups <= 63) whose
    bit sets are ``bits`` [B, T] (int64, :func:`~.reference.group_bits`). ``tile_lower`` comes in ``lower_dtype``.

    Four small Triton kernels around one sort: the layout is rebuilt for every call, so its cost is mostly the host's
    launch overhead and, in a CUDA graph, the launches' gaps. About 14 device launches in all, 7 of them the sort's
    (the segments' padded counts and both running ends take one kernel, where torch took eight launches). With one
    slot per token (m = 1) nothing waits for the device: there are no extra copies, and the slots are counted by an
    upper bound (each non-empty segment pads fewer than ``block`` slots), so up to B x ``num_groups`` - 1 tiles after
    the last sequence's last segment are padding. Otherwise one host synchronisation reads the slot and extra-copy
    counts. Extra copies are numbered in the order of ``groups``' memberships."""
    batch, length, slots = groups.shape
    device = groups.device
    count = groups.numel()
    num_segments = batch * num_groups
    groups, bits = groups.contiguous(), bits.contiguous()
    keys = torch.empty(count, dtype=sort_key_dtype((num_segments + 1) * length), device=device)
    is_extra = torch.empty(count, dtype=torch.int32, device=device)
    counts = torch.zeros(num_segments, dtype=torch.int32, device=device)
    grid = (triton.cdiv(count, _BLOCK),)
    _key_memberships[grid](groups, bits, keys, is_extra, counts, count, length, slots, num_groups, num_segments,
                           BLOCK=_BLOCK)
    sorted_keys, order = torch.sort(keys)
    bounds = torch.empty(3, num_segments, dtype=torch.int32, device=device)
    chunk = min(_BLOCK, max(32, triton.next_power_of_2(num_segments)))
    _segment_bounds[(1,)](counts, bounds, num_segments, block, BLOCK=chunk)
    padded, ends, member_ends = bounds
    if slots == 1:
        # A host synchronisation here leaves the GPU idle while the host launches everything after it (the GPU idled
        # 0.7 ms of a 4.3 ms call at 64K, K=8, on the H200), so the slot count is bounded instead of read. No token
        # has a lower group, so no copy is extra and their ranks are never read.
        total, num_extra, extra_rank = triton.cdiv(count + num_segments * (block - 1), block) * block, 0, is_extra
    else:
        extra_rank = torch.cumsum(is_extra, 0, dtype=torch.int32)
        total, num_extra = torch.stack([ends[-1], extra_rank[-1]]).tolist()  # the one synchronisation

    slot_token, slot_extra = torch.full((2, total), -1, dtype=torch.int32, device=device)  # one fill for both
    extra_rows = torch.empty(2, num_extra, dtype=torch.int64, device=device)
    _place_memberships[grid](sorted_keys, order, is_extra, extra_rank, counts, padded, ends, member_ends, slot_token,
                             slot_extra, extra_rows, count, length, num_groups, num_segments, num_extra, BLOCK=_BLOCK)
    num_tiles = total // block
    tables = torch.empty(3, num_tiles, dtype=torch.int32, device=device)
    tile_lower = torch.empty(num_tiles, dtype=lower_dtype, device=device)
    _tile_tables[(triton.cdiv(max(num_tiles, 1), _BLOCK),)](
        ends, padded, tables, tile_lower, num_tiles, num_segments, num_groups, block,
        STEPS=max(1, num_segments.bit_length()), BLOCK=_BLOCK)
    return TileLayout(block, slot_token, slot_extra, tables[0], tile_lower, tables[1], tables[2], num_extra=num_extra,
                      extra_batch=extra_rows[0], extra_token=extra_rows[1])


# Elements per program of the layout kernels.
_BLOCK = 1024


@jit
def _key_memberships(GROUPS, BITS, KEYS, IS_EXTRA, COUNTS, count, length, slots, num_groups, num_segments,
                     BLOCK: tl.constexpr):
    """Per membership: its sort key (segment * T + position; empty slots go to a segment past the last), whether it
    is an extra copy (the token has a lower group), and its segment's member count."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    group = tl.load(GROUPS + i, mask=live, other=-1)
    row = i // slots
    position = row % length
    valid = live & (group >= 0)
    segment = tl.where(valid, (row // length) * num_groups + group, num_segments)
    tl.store(KEYS + i, segment.to(KEYS.dtype.element_ty) * length + position, mask=live)
    token_bits = tl.load(BITS + row, mask=valid, other=0)
    lower = (tl.full([BLOCK], 1, tl.int64) << tl.maximum(group, 0)) - 1
    tl.store(IS_EXTRA + i, (valid & ((token_bits & lower) != 0)).to(tl.int32), mask=live)
    tl.atomic_add(COUNTS + segment, tl.full([BLOCK], 1, tl.int32), mask=valid)


@jit
def _segment_bounds(COUNTS, BOUNDS, num_segments, block, BLOCK: tl.constexpr):
    """One program, in chunks of BLOCK segments: each segment's member count padded to a multiple of ``block``, the
    running end of the padded counts (its slots' end) and of the counts (its members' end in the sorted order), as
    the rows of BOUNDS [3, num_segments]."""
    slot_end = tl.full([], 0, tl.int32)
    member_end = tl.full([], 0, tl.int32)
    for first in range(0, num_segments, BLOCK):
        s = first + tl.arange(0, BLOCK)
        live = s < num_segments
        counts = tl.load(COUNTS + s, mask=live, other=0)
        padded = (counts + block - 1) // block * block
        tl.store(BOUNDS + s, padded, mask=live)
        tl.store(BOUNDS + num_segments + s, slot_end + tl.cumsum(padded, axis=0), mask=live)
        tl.store(BOUNDS + 2 * num_segments + s, member_end + tl.cumsum(counts, axis=0), mask=live)
        slot_end += tl.sum(padded, axis=0)
        member_end += tl.sum(counts, axis=0)


@jit
def _place_memberships(SORTED_KEYS, ORDER, IS_EXTRA, EXTRA_RANK, COUNTS, PADDED, ENDS, MEMBER_ENDS, SLOT_TOKEN,
                       SLOT_EXTRA, EXTRA_ROWS, count, length, num_groups, num_segments, num_extra,
                       BLOCK: tl.constexpr):
    """Writes each sorted membership's token (and extra-copy number) at its slot: the segment's padded start plus
    the membership's rank inside the segment."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    key = tl.load(SORTED_KEYS + i, mask=live, other=0)
    segment = key // length
    position = key % length
    placed = live & (segment < num_segments)
    seg = tl.minimum(segment, num_segments - 1)
    start = tl.load(ENDS + seg) - tl.load(PADDED + seg)
    first = tl.load(MEMBER_ENDS + seg) - tl.load(COUNTS + seg)
    slot = start + (i - first)
    tl.store(SLOT_TOKEN + slot, position.to(tl.int32), mask=placed)
    source = tl.load(ORDER + i, mask=placed, other=0)
    extra = placed & (tl.load(IS_EXTRA + source, mask=placed, other=0) != 0)
    number = tl.load(EXTRA_RANK + source, mask=extra, other=1) - 1
    tl.store(SLOT_EXTRA + slot, number, mask=extra)
    tl.store(EXTRA_ROWS + number, segment // num_groups, mask=extra)
    tl.store(EXTRA_ROWS + num_extra + number, position, mask=extra)


@jit
def _tile_tables(ENDS, PADDED, TABLES, LOWER, num_tiles, num_segments, num_groups, block, STEPS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Per tile: its segment (binary search for the first padded end past the tile's first slot; empty segments
    end where they start and are skipped), sequence, segment bounds, and the bit set of the groups below its group.
    A tile past the last segment (slot counts bounded from above) gets the empty segment [slot, slot)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < num_tiles
    slot = j * block
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.full([BLOCK], num_segments, tl.int32)
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        end = tl.load(ENDS + mid, mask=mid < num_segments, other=2147483647)
        right = end <= slot
        open_ = lo < hi
        lo = tl.where(open_ & right, mid + 1, lo)
        hi = tl.where(open_ & (end > slot), mid, hi)
    past = lo >= num_segments
    seg = tl.minimum(lo, num_segments - 1)
    end = tl.load(ENDS + seg, mask=live, other=0)
    tl.store(TABLES + j, seg // num_groups, mask=live)
    tl.store(TABLES + num_tiles + j, tl.where(past, slot, end - tl.load(PADDED + seg, mask=live, other=0)), mask=live)
    tl.store(TABLES + 2 * num_tiles + j, tl.where(past, slot, end), mask=live)
    lower = (tl.full([BLOCK], 1, tl.int64) << (seg % num_groups).to(tl.int64)) - 1
    tl.store(LOWER + j, lower.to(LOWER.dtype.element_ty), mask=live)
