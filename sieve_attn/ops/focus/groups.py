"""Validated group memberships of the key tokens, with the bit sets the fast kernels read.

:func:`~sieve_attn.ops.focus.attention.focus_attention` takes either a raw id tensor, validated on every call, or a
:class:`FocusGroups`, validated once when built. A decoder keeps one per layer and :meth:`FocusGroups.extend` s it
with each step's new tokens, so a decode step validates one token, not the whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..._checks import fail
from .reference import bit_sets


@dataclass(frozen=True)
class FocusGroups:
    """ids [B, T, m] int64 (-1 = empty slot); bits [B, T] int64 bit sets (None when an id is >= 63); num_groups
    bounds the ids: largest id + 1 (0 for an empty sequence) when validated by :meth:`of`, the router's K when
    :meth:`routed`.

    Build them with :meth:`of` (validated) or :meth:`routed` (the package's routing); :meth:`extend`,
    :meth:`span` and :meth:`last` keep them valid. One built by hand is validated like raw ids when an op
    takes it (its bits recomputed), as the kernels index memory by ids and bits."""

    ids: torch.Tensor
    bits: Optional[torch.Tensor]
    num_groups: int
    trusted: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def of(cls, groups: torch.Tensor, batch: int, length: int, device: torch.device) -> "FocusGroups":
        """Validates ``groups`` ([B, T] or [B, T, m] ints, shape and device as given) with one host sync; a
        :class:`FocusGroups` the package built is taken as it is (checked for shape and device only)."""
        if isinstance(groups, FocusGroups):
            if not isinstance(groups.ids, torch.Tensor) or groups.ids.dim() != 3 or \
                    groups.ids.shape[:2] != (batch, length) or not _same_device(groups.ids.device, device):
                got = groups.ids.shape if isinstance(groups.ids, torch.Tensor) else type(groups.ids).__name__
                fail("groups", f"FocusGroups of ids [B={batch}, T={length}, m] on {device}",
                     f"ids {got}" + (f" on {groups.ids.device}" if isinstance(groups.ids, torch.Tensor) else ""))
            if groups.trusted:
                return groups
            validated = cls.of(groups.ids, batch, length, device)
            if validated.num_groups > groups.num_groups:
                fail("groups", f"FocusGroups whose num_groups bounds its ids (at least {validated.num_groups})",
                     groups.num_groups)
            return cls.routed(validated.ids, groups.num_groups)
        ids, num_groups = _checked_ids(groups, batch, length, device)
        # num_groups is the largest id + 1, read by the validation's one sync: the bit sets need no second one
        return cls(ids, bit_sets(ids) if num_groups <= 63 else None, num_groups, trusted=True)

    @classmethod
    def routed(cls, ids: torch.Tensor, num_groups: int) -> "FocusGroups":
        """Memberships the package's own routing produced (:func:`.routing.hard_groups`: ids [B, T, m] int64 in
        [-1, ``num_groups``), distinct within a token, each token in at least one group), valid by construction:
        taken without :meth:`of`'s validation and its host sync, which a decode step would pay in every layer.
        ``num_groups`` (the router's K) bounds the ids."""
        return cls(ids, bit_sets(ids) if num_groups <= 63 else None, num_groups, trusted=True)

    def extend(self, new: "FocusGroups") -> "FocusGroups":
        """The memberships of these tokens followed by those of ``new`` (slot counts padded with -1)."""
        width = max(self.ids.shape[2], new.ids.shape[2])
        ids = torch.cat([_pad_slots(self.ids, width), _pad_slots(new.ids, width)], dim=1)
        bits = None if self.bits is None or new.bits is None else torch.cat([self.bits, new.bits], dim=1)
        return FocusGroups(ids, bits, max(self.num_groups, new.num_groups), trusted=self.trusted and new.trusted)

    def span(self, start: int, stop: int) -> "FocusGroups":
        """The memberships of tokens start..stop-1."""
        return FocusGroups(self.ids[:, start:stop], None if self.bits is None else self.bits[:, start:stop],
                           self.num_groups, trusted=self.trusted)

    def last(self, count: int) -> "FocusGroups":
        return self.span(self.length - count, self.length)

    def rows(self, indices: torch.Tensor) -> "FocusGroups":
        """The memberships of batch rows ``indices`` (a [B'] index tensor; rows may repeat), in that order."""
        indices = indices.to(self.ids.device)
        return FocusGroups(self.ids.index_select(0, indices),
                           None if self.bits is None else self.bits.index_select(0, indices), self.num_groups,
                           trusted=self.trusted)

    @property
    def length(self) -> int:
        return self.ids.shape[1]


def _same_device(actual: torch.device, expected) -> bool:
    """``cuda`` names the current CUDA device, as ``cuda:0`` may."""
    expected = torch.device(expected)
    if expected.type == "cuda" and expected.index is None:
        expected = torch.device("cuda", torch.cuda.current_device())
    return actual == expected


def _pad_slots(ids: torch.Tensor, width: int) -> torch.Tensor:
    if ids.shape[2] == width:
        return ids
    return torch.cat([ids, ids.new_full((*ids.shape[:2], width - ids.shape[2]), -1)], dim=-1)


def _checked_ids(groups, batch: int, k_len: int, device) -> tuple[torch.Tensor, int]:
    """``groups`` as [B, T, m] int64 (slots that no token fills dropped) and the number of ids in use; ValueError
    naming what is wrong."""
    if not isinstance(groups, torch.Tensor):
        fail("groups", "an integer tensor [B, T] or [B, T, m]", type(groups).__name__)
    if groups.dtype.is_floating_point or groups.dtype.is_complex or groups.dtype == torch.bool:
        fail("groups", "an integer dtype", groups.dtype)
    if groups.dim() not in (2, 3):
        fail("groups", f"shape [B, T] or [B, T, m] with B={batch}, T={k_len}", f"shape {tuple(groups.shape)}")
    if groups.shape[0] != batch or groups.shape[1] != k_len:
        fail("groups", f"shape [B, T, ...] with B={batch}, T={k_len} (one entry per key token)",
             f"shape {tuple(groups.shape)}")
    if not _same_device(groups.device, device):
        fail("groups", f"a tensor on {device}", groups.device)
    slots = (groups if groups.dim() == 3 else groups[..., None]).long()
    if slots.shape[2] == 0:
        fail("groups", "at least one membership slot (m >= 1)", "m = 0")
    if slots.numel() == 0:
        return slots, 0
    ordered = slots.sort(dim=-1).values if slots.shape[2] > 1 else slots
    repeated = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()
    homeless = ~(slots >= 0).any(dim=-1).all()
    used = (slots >= 0).flatten(0, 1).any(0)  # [m]: slots some token fills
    low, high, repeated, homeless, *used = torch.cat([torch.stack([slots.min(), slots.max(), repeated, homeless]),
                                                     used]).tolist()
    floor = -1 if groups.dim() == 3 else 0
    if low < floor:
        fail("groups", f"group ids >= {floor}" + (" (-1 marks an empty slot)" if floor < 0 else ""), low)
    if homeless:
        fail("groups", "every token in at least one group", "a token whose slots are all -1")
    if repeated:
        fail("groups", "distinct group ids among a token's slots", "a token listing one group twice")
    if not all(used):  # a slot no token fills changes nothing but the backends' paths (several memberships)
        slots = slots[..., [index for index, filled in enumerate(used) if filled]]
    return slots, high + 1
