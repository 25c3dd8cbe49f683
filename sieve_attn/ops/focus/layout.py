"""Tiled layouts of the two disjoint pair sets of the Focus pattern, as the fast kernels walk them.

The hard Focus pattern splits exactly into
- the **group set**: pairs whose tokens share a group, each counted in the lowest group they share (DESIGN.md,
  decision 4), and
- the **window set**: pairs inside the local window, 0 <= i - j <= window, whose tokens share no group.

Both sets are walked over a *layout*: a 1-d sequence of slots, each holding a token index (or -1 for padding), cut
into tiles of ``block`` slots and grouped in segments (a sequence, or one group of one sequence). A tile is a block
of queries in the forward pass and a block of keys in the backward pass; the kernels derive the slot range each
tile reads from its segment bounds (the keys before a query in its segment, or ``window`` positions back).

- Group layout: every (batch, group) membership of every token, stable-sorted by (batch, group, position), each
  group's segment padded to a multiple of ``block``. Inside a segment slots follow positions, so causality is
  "key slot <= query slot" and a group costs causal dense attention on its own members. A token with m memberships
  appears m times; its copy in its lowest group has rank 0, the others rank 1.. and a compact ``slot_extra`` index.
- Window layout: each sequence in position order, padded to a multiple of ``block``; a query tile reads the keys
  from ``window`` positions before it up to its own end.

Building a layout costs one sort of the memberships and one host synchronisation (the number of tiles).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileLayout:
    """Slots and tiles of one pair set. Slot tensors are [P] int32, tile tensors [P // block] int32 (int64 bits)."""

    block: int
    slot_token: torch.Tensor    # token position of each slot, -1 = padding
    slot_extra: torch.Tensor    # -1 for a token's rank-0 copy, else the copy's index in the extra-output buffers
    tile_batch: torch.Tensor    # sequence of each tile
    tile_lower: torch.Tensor    # int64 bit set of the groups below the tile's group (0 in the window layout)
    tile_seg_start: torch.Tensor  # first slot of the tile's segment
    tile_seg_end: torch.Tensor    # one past the last slot of the tile's segment (a multiple of block)
    num_extra: int              # copies of rank >= 1 (tokens with several memberships)

    @property
    def num_tiles(self) -> int:
        return self.tile_batch.numel()


def _int32(*tensors):
    return [t.to(torch.int32).contiguous() for t in tensors]


@functools.lru_cache(maxsize=16)
def window_layout(batch: int, length: int, block: int, device) -> TileLayout:
    """Layout of the window set: each of ``batch`` sequences of ``length`` tokens in order, padded to ``block``.
    Cached: every layer of a model forward uses the same one."""
    tiles_per_seq = -(-length // block)
    padded = tiles_per_seq * block
    position = torch.arange(padded, device=device)
    slot_token = torch.where(position < length, position, -1).repeat(batch)
    tile_batch = torch.arange(batch, device=device).repeat_interleave(tiles_per_seq)
    seg_start = tile_batch * padded
    return TileLayout(block, *_int32(slot_token, torch.full_like(slot_token, -1), tile_batch),
                      torch.zeros_like(tile_batch), *_int32(seg_start, seg_start + padded), num_extra=0)


def group_layout(groups: torch.Tensor, block: int, num_groups: int | None = None) -> TileLayout:
    """Layout of the group set for memberships ``groups`` [B, T, m] (-1 = empty slot, ids < num_groups).

    Built with fixed-size tensor ops and a single host synchronisation (for the slot and extra-copy counts)."""
    batch, length, slots = groups.shape
    device = groups.device
    num_groups = int(groups.max()) + 1 if num_groups is None else num_groups
    valid = groups >= 0
    num_segments = batch * num_groups
    seq = torch.arange(batch, device=device)[:, None, None]
    pos = torch.arange(length, device=device)[None, :, None].expand_as(groups).reshape(-1)
    # Empty slots go to one extra segment past the last, which is counted but never laid out.
    segment = torch.where(valid, seq * num_groups + groups, num_segments).reshape(-1)
    order = torch.sort(segment * length + pos, stable=True).indices
    segment, token = segment[order], pos[order]
    if slots > 1:  # rank of a membership among its token's groups: how many of the token's groups have smaller ids
        rank = ((groups[..., None, :] < groups[..., :, None]) & valid[..., None, :]).sum(-1).reshape(-1)[order]
    else:
        rank = torch.zeros_like(token)
    laid_out = segment < num_segments
    is_extra = laid_out & (rank > 0)

    counts = torch.zeros(num_segments + 1, dtype=torch.int64, device=device).index_add_(
        0, segment, torch.ones_like(segment))[:num_segments]
    padded = (counts + block - 1) // block * block
    padded_start = torch.cumsum(padded, 0) - padded
    first_member = torch.cumsum(counts, 0) - counts
    total, num_extra = torch.stack([padded.sum(), is_extra.sum()]).tolist()  # the one synchronisation

    seg = segment.clamp_max(num_segments - 1)
    slot = torch.where(laid_out, padded_start[seg] + torch.arange(segment.numel(), device=device) - first_member[seg],
                       total)  # slot `total` is a scratch slot for the empty memberships
    slot_token = torch.full((total + 1,), -1, dtype=torch.int64, device=device)
    slot_token[slot] = token
    slot_extra = torch.full((total + 1,), -1, dtype=torch.int64, device=device)
    slot_extra[torch.where(is_extra, slot, total)] = torch.where(is_extra, torch.cumsum(is_extra, 0) - 1, -1)

    tile_segment = torch.repeat_interleave(torch.arange(num_segments, device=device), padded // block,
                                           output_size=total // block)
    tile_group = tile_segment % num_groups
    seg_start = padded_start[tile_segment]
    return TileLayout(block, *_int32(slot_token[:total], slot_extra[:total], tile_segment // num_groups),
                      (1 << tile_group) - 1, *_int32(seg_start, seg_start + padded[tile_segment]),
                      num_extra=num_extra)
