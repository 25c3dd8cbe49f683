"""Decomposition backend of hard Focus attention (``backend="sdpa"``), forward and backward: the pattern as two
disjoint pair sets, each computed by fused SDPA-family kernels (:mod:`.sdpa_ops`), merged by log-sum-exp.

- **Group set**: pairs whose tokens share a group, each counted in the lowest group the two share (docs/decisions.md,
  decision 4). Memberships are sorted by (sequence, group, position), one copy of a token per group it is in; each
  non-empty (sequence, group) is a segment, padded at its end to the longest segment's L slots: a batch [S, H, L, D].
  - Causal with one membership per token: ONE batched causal call over all segments (cuDNN, else flash, else the
    memory-efficient kernel; the CPU op off CUDA). Padded keys sit after every real query of their segment, so
    causality hides them; padded query rows are dropped.
  - Causal with at most two memberships per token: inclusion-exclusion, two batched causal calls. The first runs
    over every copy of every token, so a pair whose tokens share two groups (both tokens in exactly the groups a and
    b) is counted in both segments; the second runs over the tokens grouped by their pair of groups (segments of the
    class a * K + b), and its partials are subtracted in the merge (:func:`~sieve_attn.ops.merge.merge_indexed`).
    Exact in exact arithmetic. The rounded partials of a query's three calls enter the merge with weights summing
    to 1 + 2 d, where d is the query's share of softmax mass on keys of its own pair of groups (up to 1 early in a
    sequence, where its own key dominates): with bf16 partials that broke the tests' precision rule, so bf16
    inputs run these calls on float16 copies (:meth:`CallInputs.queue_half_copies`, made as they are packed), 3
    more bits per partial. The backward needs no subtraction: the Triton kernels' on CUDA (each pair once, from the
    final output and log-sum-exp), the masked calls' on the CPU.
  - Otherwise with several memberships (the lowest-shared-group rule), or not causal (padded keys would be seen):
    masked calls over chunks of query slots (the memory-efficient kernel's additive bias on CUDA, the CPU op's
    attn_mask).
- **Window set**: pairs with 0 <= i - j <= window whose tokens share no group, in position order.
  - On CUDA (ids < 63, a head dim the kernels take): the Triton window kernel of :mod:`.triton_prefill`, one pass
    over the local tiles. The SDPA kernels have no such pattern: as masked calls it cost more than the group set.
  - Elsewhere: masked calls. A query block of P positions reads the keys from ``window`` positions before it to its
    own end, with a mask; blocks are batched into calls of bounded size, so memory is O(T x (P + window)) at most,
    never T x T.

Together the sets are exactly the pattern, so merging their partial results (out, lse) by log-sum-exp, with those of
a token's copies, is exact. A query's own pair lies in its lowest group, so its log-sum-exp is finite. The host
queues first what it must read (the layouts' sorts, each ending in one read of its sizes, and the largest
magnitudes of the float16 copies), then the window kernel: it needs no sorted layout, so the device works on it
while the host waits for those reads and launches the group set (without the kernel, on the CPU say, masked calls
compute the window set after the group set). One kernel then merges each token's partials: the window's, one per
copy and, in inclusion-exclusion, the subtracted one (:func:`~sieve_attn.ops.merge.merge_indexed`).

Backward (the FlashAttention-2 identity): given the final output O and log-sum-exp L of each query, a pair's gradient
depends only on that pair: P_ij = exp(s_ij - L_i), dS_ij = P_ij (dO_i . v_j - dO_i . O_i). So each fused call's own
backward op, fed O and L gathered into its layout in place of its own, returns its share of dq, dk, dv; the shares of
token copies and of both sets are summed (index_add, float32). No gradient flows through lse.

GQA/MQA: K and V stay per KV head. They are copied once into the sorted layout (and the window's key blocks), never
per query head: the CPU, cuDNN and flash ops take GQA natively, the memory-efficient one runs per query head of a KV
head's group on views of q (:mod:`.sdpa_ops`).

Uneven and empty groups: only non-empty segments exist; padding costs at most S x L - E slots of the longest group.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ..gather import gather_rows
from ..magnitude import largest_magnitudes
from ..merge import merge_indexed
from ..triton_common import kernel_blocker, on_device_of
from . import segments
from .groups import FocusGroups
from .layout import sort_key_dtype
from .sdpa_ops import causal_call, masked_family

# Pair-mask elements of one masked call (its bias and group tests are as large): 2**24 keeps a call's temporaries
# to a few hundred MiB at most, whatever T and the window.
MASK_ELEMENTS = 2 ** 24
# Query block of the window set: the window rounded up to a multiple of MIN_BLOCK, within [MIN_BLOCK, MAX_BLOCK].
# A block at least as long as the window reads under twice the window's keys per query; the cap bounds one block.
MIN_BLOCK = 64
MAX_BLOCK = 1024


def sdpa_blocker(q: torch.Tensor, k: torch.Tensor, softcap, attn_mask, lse_needs_grad: bool = False) -> Optional[str]:
    """Why the decomposition backend cannot compute this call, or None when it can. ``lse_needs_grad``: the call
    returns lse while autograd records (its cuDNN backward ops take no gradient of the log-sum-exp)."""
    if lse_needs_grad:
        return "the sdpa backend's lse carries no gradient (return_lse=True with inputs that require grad)"
    if attn_mask is not None:
        return "the sdpa backend takes no attn_mask"
    if softcap is not None:
        return "the sdpa backend takes no softcap (the fused SDPA kernels have no logit soft-capping)"
    if q.shape[2] != k.shape[2]:
        return f"the sdpa backend takes Tq == Tk (prefill, training), got Tq={q.shape[2]}, Tk={k.shape[2]}"
    if q.device.type not in ("cpu", "cuda"):
        return f"the sdpa backend takes CPU or CUDA tensors, got {q.device.type}"
    return None


def focus_attention_sdpa(q, k, v, groups: FocusGroups, *, window: int, causal: bool, scale: float):
    """Hard Focus attention through the decomposition. Arguments as validated by
    :func:`sieve_attn.ops.focus.attention.focus_attention`, with Tq == Tk and :func:`sdpa_blocker` None.

    Returns (out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] float32). Gradients flow to q, k, v (not through lse)."""
    with on_device_of(q):  # Triton launches (packing, window kernel) go to the current device
        plan = _Plan(groups, q, k, window=window, causal=causal, scale=scale)
        out, lse = PlanAttention.apply(q, k, v, plan)
    return out, lse.float()


class PlanAttention(torch.autograd.Function):
    """Attention computed by a plan: ``plan.forward(q, k, v) -> (out, lse)`` and ``plan.backward(q, k, v, out, lse,
    grad_out[, grad_lse]) -> (dq, dk, dv)``; out, lse and the inputs are kept for the backward. lse gets a gradient
    where the plan's ``lse_has_gradient`` says so (its backward then takes ``grad_lse``, None when lse was not
    used), and is non-differentiable otherwise."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = plan.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        if not plan.lse_has_gradient:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out  # a loss on lse alone
        extra = (grad_lse,) if ctx.plan.lse_has_gradient else ()
        with on_device_of(q):  # autograd's device thread is q's already; compiled autograd may not set it
            return (*ctx.plan.backward(q, k, v, out, lse, grad_out, *extra), None)


# ---------------------------------------------------------------------------------------------------- layouts

def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class SortedGroups:
    """Memberships sorted by (sequence, group, position). The S non-empty (sequence, group) pairs are segments of
    L slots (L = the largest member count): member r of segment s sits at [s, :, r] of a [S, H, L, ...] layout,
    later slots are padding. E memberships in all, each one copy of its token. Layouts move between token order and
    the segments by :func:`~sieve_attn.ops.gather.gather_rows` (one copy of each row)."""

    member_token: torch.Tensor   # [E] the token (b * T + t) of each membership
    member_entry: torch.Tensor   # [E] its entry (b * T + t) * m + j in the ids (slot j of the token's m)
    counts: torch.Tensor         # [S] members of each segment
    segment_group: torch.Tensor  # [S] group id of each segment
    slot_token: torch.Tensor     # [S * L] the token (b * T + t) in each slot, -1 for padding
    member_slot: torch.Tensor    # [E] the slot (s * L + r) of each membership
    entry_slot: torch.Tensor     # [B * T * m] the slot of each entry of the ids, -1 for an empty one
    one_each: bool               # every token has exactly one membership (m = 1, no empty slot)
    sequences: int               # B
    tokens: int                  # T
    id_slots: int                # m
    length: int                  # L

    @property
    def token_slot(self) -> Optional[torch.Tensor]:
        """[B * T] the slot of each token, with one membership each (else None)."""
        return self.entry_slot if self.one_each else None

    @property
    def multi(self) -> bool:
        """Whether a token may have several memberships (m > 1)."""
        return self.id_slots > 1

    @classmethod
    def of(cls, ids: torch.Tensor, num_groups: int) -> "SortedGroups":
        """ids: [B, T, m] int64 in [0, num_groups), -1 = empty slot; a token lists an id at most once. With m == 1
        every token has a group (validated); with m > 1 a token may have none (it gets no slot)."""
        return cls.start(ids, num_groups).finish()

    @classmethod
    def start(cls, ids: torch.Tensor, num_groups: int,
              partial: bool = False) -> "_SortInFlight | segments.KernelSortInFlight":
        """:meth:`of` in two halves: this one queues the device work and the read of the three sizes that shape the
        layout (the longest segment, the number of segments and of memberships); the returned object's ``finish()``
        (:meth:`_SortInFlight.finish`, :meth:`.segments.KernelSortInFlight.finish`) waits for that read. Work
        queued in between runs on the device while the host waits, and the host waits for nothing else. ``partial``:
        with one slot, some tokens may have no group (-1).

        On CUDA a few Triton kernels (:mod:`.segments`) do what the PyTorch code below does, from the same sort."""
        if segments.serves(ids):
            return segments.start(ids, num_groups, partial, _read_later)
        batch, length, slots = ids.shape
        flat = ids.reshape(-1)
        token = torch.arange(flat.numel(), device=ids.device) // slots
        complete = slots == 1 and not partial  # every entry a membership (validated)
        # Empty slots get a key past every membership's, so they sort to the end, where finish() drops them.
        past = batch * num_groups * length
        key = ((token // length) * num_groups + flat) * length + token % length
        if not complete:
            key = torch.where(flat >= 0, key, past)
        # The keys of memberships are distinct, so the order is the stable one: members of a group stay in
        # position order. In int32 when they fit (half the radix passes).
        key, entry = torch.sort(key.to(sort_key_dtype(past)))  # the order is each membership's entry in the ids
        token, group, segment_key = token[entry], flat[entry], key // length
        # Segments are the runs of equal keys, at most N of them, so [N] tensors hold their sizes and one read gives
        # the layout's; memory O(B x T x m) whatever the ids.
        new = torch.ones_like(segment_key, dtype=torch.bool)
        new[1:] = segment_key[1:] != segment_key[:-1]
        segment = torch.cumsum(new, 0) - 1
        # Each segment's first and end entries (N past the last) by searches rather than counting atomics, which
        # contend on the few segments. Empty slots form a last segment without members.
        positions = torch.arange(segment.numel(), device=ids.device)
        first, end = torch.searchsorted(segment, positions), torch.searchsorted(segment, positions + 1)
        if complete:
            members = end - first
        else:
            real = key < past
            count = real.sum()
            members = (torch.minimum(end, count) - first).clamp_min(0)
        rank = positions - first[segment]
        segment_group = torch.zeros_like(segment).scatter_(0, segment, group)
        if not segment.numel():
            sizes = torch.zeros(3, dtype=torch.long)
        elif complete:
            sizes = torch.stack([members.max(), segment[-1] + 1, segment.new_full((), segment.numel())])
        else:
            sizes = torch.stack([members.max(), (new & real).sum(), count])
        return _SortInFlight(token, entry, segment, rank, members, segment_group, batch, length, slots,
                             one_each=complete, sizes=_read_later(sizes))

    @property
    def num_segments(self) -> int:
        return self.counts.numel()

    def pack(self, x: torch.Tensor, factor: float = 1.0, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """[B, H, T, *rest] -> [S, H, L, *rest] (rest: () or (D,)), contiguous, zeros in the padding slots; the
        values times ``factor``, in ``dtype`` (default x's), as :func:`~sieve_attn.ops.gather.gather_rows` says."""
        return _rows_of(x, self.slot_token, self.num_segments, self.length, factor, dtype)

    def rows(self, y: torch.Tensor) -> torch.Tensor:
        """[S, H, L, *rest] -> [E, H, *rest]: the rows of the memberships."""
        return _rows_of(y, self.member_slot, self.member_slot.numel(), 1).squeeze(2)

    def to_tokens(self, y: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """[S, H, L, *rest] -> [B, H, T, *rest]: each token's rows summed over its copies (with one membership per
        token, its one row; 0 for a token with none), in ``dtype`` (default y's)."""
        if self.token_slot is not None:
            return _rows_of(y, self.token_slot, self.sequences, self.tokens).to(dtype or y.dtype)
        rows = self.rows(y).to(dtype or y.dtype)
        total = rows.new_zeros(self.sequences * self.tokens, *rows.shape[1:]).index_add_(0, self.member_token, rows)
        return total.unflatten(0, (self.sequences, self.tokens)).transpose(1, 2)

    def slot_tokens(self) -> torch.Tensor:
        """[S, L] int64: the token (b * T + t) in each slot, -1 for padding."""
        return self.slot_token.view(self.num_segments, self.length)

    def entry_slots(self) -> torch.Tensor:
        """[B * T, m] int64: the slot (s * L + r) of each token's membership in each of its m id slots, -1 for an
        empty one; the part index of :func:`~sieve_attn.ops.merge.merge_indexed`."""
        return self.entry_slot.view(-1, self.id_slots)


def _read_later(values: torch.Tensor):
    """A function returning ``values.tolist()``. On CUDA the copy to the host is queued now (pinned memory, an
    event after it), so work queued after this call overlaps the wait for it."""
    if values.device.type != "cuda":
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    with torch.cuda.device(values.device):  # the event must follow the copy on the stream of values' device
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

    def read():
        copied.synchronize()
        return host.tolist()
    return read


@dataclass(frozen=True)
class _SortInFlight:
    """The device half of :meth:`SortedGroups.of` built by PyTorch ops (off CUDA; the reference of
    :mod:`.segments`), before the read of the sizes: N = B x T x m entries sorted, the E memberships first."""

    token: torch.Tensor          # [N] the token of each entry
    entry: torch.Tensor          # [N] its index in the ids
    segment: torch.Tensor        # [N] its segment
    rank: torch.Tensor           # [N] its place in the segment
    members: torch.Tensor        # [N] members of segment s at s < S, zeros after
    segment_group: torch.Tensor  # [N] the group of segment s at s < S
    sequences: int
    tokens: int
    id_slots: int
    one_each: bool               # every token has exactly one membership (m = 1, no empty slot)
    sizes: object                # () -> [longest, number of segments, number of memberships]

    def finish(self) -> SortedGroups:
        longest, num_segments, count = self.sizes()
        token, entry = self.token[:count], self.entry[:count]
        member_slot = self.segment[:count] * longest + self.rank[:count]
        device = self.token.device
        slot_token = torch.full((num_segments * longest,), -1, dtype=torch.long, device=device)
        slot_token[member_slot] = token
        entry_slot = torch.full((self.sequences * self.tokens * self.id_slots,), -1, dtype=torch.long,
                                device=device)
        entry_slot[entry] = member_slot
        return SortedGroups(token, entry, self.members[:num_segments], self.segment_group[:num_segments], slot_token,
                            member_slot, entry_slot, self.one_each, self.sequences, self.tokens, self.id_slots,
                            length=longest)


def _pair_classes(ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[B, T, 1] int64 of [B, T, 2] ids: a * K + b for a token in the groups a < b (K = num_groups), -1 for a token
    in one group."""
    low, high = ids.min(-1).values, ids.max(-1).values  # an empty slot (-1) is the minimum
    return torch.where(low >= 0, low * num_groups + high, -1)[..., None]


def _rows_of(x: torch.Tensor, index: torch.Tensor, outer: int, inner: int, factor: float = 1.0,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`~sieve_attn.ops.gather.gather_rows` of [A, H, I, D] or [A, H, I] tensors."""
    if x.dim() == 3:
        return gather_rows(x[..., None], index, outer, inner, factor, dtype)[..., 0]
    return gather_rows(x, index, outer, inner, factor, dtype)


@dataclass(frozen=True)
class CallInputs:
    """How q, k and v enter the fused calls of the group set: packed into a layout, each times a power of two
    (``factors``) and rounded to ``dtype`` (None: each keeps its own) in the same pass, with the logit scale
    ``scale``."""

    factors: tuple[float, float, float]
    dtype: Optional[torch.dtype]
    scale: float

    @classmethod
    def plain(cls, scale: float) -> "CallInputs":
        """q, k, v packed as they are."""
        return cls((1.0, 1.0, 1.0), None, scale)

    @classmethod
    def queue_half_copies(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float) -> Callable[[], "CallInputs"]:
        """bfloat16 q, k, v as float16 copies scaled by powers of two, q by 2^a, k by 2^b, v by 2^c, the logit scale
        by 2^-(a+b), so that each copy's largest magnitude lies in [2^13, 2^14) (float16 ends at 65504). The logits
        are unchanged and the outputs are 2^c times the true ones. A bfloat16 value down to 2^-28 of its tensor's
        largest is exact in float16 (smaller ones round to float16's subnormals, an error below 2^-38 of that
        largest), and float16 outputs carry 11 significant bits to bfloat16's 8.

        Queues the three largest magnitudes and their copy to the host; the returned function waits for that one
        read and gives the CallInputs."""
        read = _read_later(largest_magnitudes((q, k, v)))

        def finish() -> "CallInputs":
            # at most 2^100, so that the factors stay float32 numbers for the tiniest tensors (their smallest values
            # then round to float16's subnormals)
            a, b, c = (min(14 - math.frexp(m)[1], 100) if 0 < m < math.inf else 0 for m in read())
            return cls((2.0 ** a, 2.0 ** b, 2.0 ** c), torch.float16, scale * 2.0 ** -(a + b))
        return finish

    def pack(self, layout: "SortedGroups", q, k, v) -> list[torch.Tensor]:
        """q, k, v [B, H, T, D] in ``layout``: [S, H, L, D] each."""
        return [layout.pack(t, factor, self.dtype) for t, factor in zip((q, k, v), self.factors)]

    @property
    def value_unit(self) -> float:
        """What turns a call's output into the true one: 2^-c."""
        return 1.0 / self.factors[2]


class _TokenSets:
    """The group memberships of every token of the batch, looked up by flat token index b * T + t; index -1 is a
    padding token, in no group. Bit sets when the ids allow (< 63), else the id lists."""

    def __init__(self, groups: FocusGroups):
        ids = groups.ids.flatten(0, 1)  # [B*T, m]
        self.pad = ids.shape[0]
        if groups.bits is not None:
            self.bits = torch.cat([groups.bits.flatten(), groups.bits.new_zeros(1)])
            self.ids = None
        else:
            self.bits = None
            self.ids = torch.cat([ids, ids.new_full((1, ids.shape[1]), -1)])

    def _lookup(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return table[torch.where(tokens >= 0, tokens, self.pad)]

    def shared(self, q_tok: torch.Tensor, k_tok: torch.Tensor,
               below: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[N, M, S] bool: query token q_tok[n, i] and key token k_tok[n, j] share a group, one with id < below[n]
        when ``below`` [N] is given (the lowest-shared-group rule of segment n's group)."""
        if self.bits is not None:
            q_bits, k_bits = self._lookup(self.bits, q_tok), self._lookup(self.bits, k_tok)
            if below is not None:
                q_bits = q_bits & ((1 << below) - 1)[:, None]
            return (q_bits[:, :, None] & k_bits[:, None, :]) != 0
        q_ids, k_ids = self._lookup(self.ids, q_tok), self._lookup(self.ids, k_tok)  # [N, M, m], [N, S, m]
        if below is not None:
            q_ids = torch.where(q_ids < below[:, None, None], q_ids, -1)
        shared = torch.zeros(*q_tok.shape, k_tok.shape[1], dtype=torch.bool, device=q_tok.device)
        for slot in range(q_ids.shape[2]):
            mine = q_ids[:, :, slot]
            shared |= (mine[:, :, None, None] == k_ids[:, None]).any(-1) & (mine >= 0)[:, :, None]
        return shared


@dataclass(frozen=True)
class _WindowBlocks:
    """Query blocks of the window set: block b holds positions [b P, b P + P) and reads the keys at positions
    [b P - W, b P + P) (W = the window, clipped to T - 1); ``per_call`` blocks of every sequence go in one call."""

    block: int     # P
    reach: int     # W
    count: int     # blocks per sequence
    per_call: int

    @classmethod
    def of(cls, batch: int, length: int, window: int) -> "_WindowBlocks":
        reach = min(window, length - 1)
        block = min(MAX_BLOCK, max(MIN_BLOCK, _round_up(reach, MIN_BLOCK)), _round_up(length, 8))
        # A wide window makes a block's mask P x (P + W): shrink P so that one block of every sequence fits.
        fits = MASK_ELEMENTS // (batch * (block + reach))
        if fits < block:
            block = max(8, fits // 8 * 8)
        per_call = max(1, MASK_ELEMENTS // (batch * block * (block + reach)))
        return cls(block, reach, -(-length // block), per_call)

    def calls(self) -> Iterator[tuple[int, int]]:
        """(b0, b1): the blocks of one masked call."""
        for b0 in range(0, self.count, self.per_call):
            yield b0, min(self.count, b0 + self.per_call)

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, *rest] -> [B, H, count * P, *rest], zeros after T."""
        tail = self.count * self.block - x.shape[2]
        return torch.cat([x, x.new_zeros(*x.shape[:2], tail, *x.shape[3:])], dim=2)

    def pad_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] -> [B, H, W + count * P, D]: W zeros before position 0, zeros after T."""
        head = x.new_zeros(*x.shape[:2], self.reach, x.shape[3])
        return torch.cat([head, self.pad_queries(x)], dim=2)

    def query_blocks(self, x: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
        """Padded queries [B, H, count * P, *rest] -> blocks b0..b1-1 as [B * n, H, P, *rest]."""
        part = x[:, :, b0 * self.block:b1 * self.block].unflatten(2, (b1 - b0, self.block))
        return part.transpose(1, 2).flatten(0, 1)

    def unblock(self, y: torch.Tensor, batch: int) -> torch.Tensor:
        """Inverse of :meth:`query_blocks`: [B * n, H, P, *rest] -> [B, H, n * P, *rest]."""
        return y.unflatten(0, (batch, -1)).transpose(1, 2).flatten(2, 3)

    def key_blocks(self, x: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
        """Padded keys [B, H, W + count * P, D] -> the keys of blocks b0..b1-1 as [B * n, H, P + W, D]."""
        span = self.block + self.reach
        part = x[:, :, b0 * self.block:b1 * self.block + self.reach].unfold(2, span, self.block)
        return part.transpose(-1, -2).transpose(1, 2).flatten(0, 1)

    def add_key_blocks(self, total: torch.Tensor, blocks: torch.Tensor, b0: int, b1: int) -> None:
        """Adds key-block gradients [B * n, H, P + W, D] into ``total`` [B, H, W + count * P, D] (blocks overlap)."""
        span = self.block + self.reach
        spread = blocks.unflatten(0, (total.shape[0], b1 - b0)).transpose(1, 2).flatten(2, 3)
        index = (torch.arange(b1 - b0, device=total.device)[:, None] * self.block
                 + torch.arange(span, device=total.device)[None, :]).flatten()
        total[:, :, b0 * self.block:b1 * self.block + self.reach].index_add_(2, index, spread.to(total.dtype))


def window_kernel_serves(q: torch.Tensor, groups: FocusGroups) -> bool:
    """Whether the window set runs as the Triton window kernel: on CUDA, for ids < 63 (bit sets) and a q the
    kernels take (dtype, head dim)."""
    return q.device.type == "cuda" and groups.bits is not None and kernel_blocker(q) is None


def _clear_empty(out: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor):
    """Rows of a masked call with no allowed key get out 0 and lse -inf (kernels differ there: 0 and 0, or NaN)."""
    empty = ~allowed.any(-1)  # [N, 1, M]
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


# ---------------------------------------------------------------------------------------------------- the plan

class _Plan:
    """What the forward and backward of one call share: the sorted memberships, the window blocks, the settings,
    the causal call's family and what the fused calls saved for their backward ops. Its lse carries no gradient
    (:func:`sdpa_blocker`)."""

    lse_has_gradient = False

    def __init__(self, groups: FocusGroups, q, k, *, window: int, causal: bool, scale: float):
        self.batch, self.length = q.shape[0], q.shape[2]
        self.groups = groups
        self.multi = groups.ids.shape[2] > 1
        # Inclusion-exclusion (module docstring) while the class keys a * K + b of the sort fit in int64, where the
        # backward has an exact path that needs no forward state (the Triton kernels on CUDA, the CPU op's masks),
        # and not for float16 inputs: no wider 16-bit type holds their partials (bf16 ones go to float16).
        self.subtracts = (causal and self.multi and groups.ids.shape[2] == 2 and q.dtype != torch.float16
                          and groups.num_groups ** 2 * self.batch * self.length < 2 ** 62
                          and (q.device.type == "cpu" or window_kernel_serves(q, groups)))
        self.sets = _TokenSets(groups)
        self.window, self.causal, self.scale = window, causal, scale
        # window 0: the window set is empty (a token always shares a group with itself)
        self.blocks = _WindowBlocks.of(self.batch, self.length, window) if window > 0 else None
        self.window_kernel = None
        if self.blocks and window_kernel_serves(q, groups):
            from .triton_prefill import WindowSet  # it imports this module
            self.window_kernel = WindowSet(groups.bits, groups.num_groups, self.batch, self.length, k.shape[1],
                                           window, causal, scale, None, q.device)
        # the group set as causal calls (one per layout), not masked ones
        self.fast = causal and (not self.multi or self.subtracts)
        self.masked = masked_family(q.device)
        self.causal_family = None
        self.saved: dict = {}
        self._sorting = self._pair_sorting = None  # queued by the forward (_queue_sorts)

    def _queue_sorts(self) -> None:
        """Queues each layout's sort and the read of its sizes (:meth:`SortedGroups.start`); :attr:`sorted` and
        :attr:`pairs` wait for those reads."""
        self._sorting = SortedGroups.start(self.groups.ids, self.groups.num_groups)
        if self.subtracts:
            self._pair_sorting = SortedGroups.start(_pair_classes(self.groups.ids, self.groups.num_groups),
                                                    self.groups.num_groups ** 2, partial=True)

    @functools.cached_property
    def sorted(self) -> SortedGroups:
        # the sort's temporaries are dropped, not kept with the plan until the backward
        layout, self._sorting = self._sorting.finish(), None
        return layout

    @functools.cached_property
    def pairs(self) -> Optional[SortedGroups]:
        """The tokens in two groups, sorted by (sequence, pair of groups, position), when the group set is
        inclusion-exclusion and some token is in two groups; else None."""
        in_flight, self._pair_sorting = self._pair_sorting, None
        layout = in_flight.finish() if in_flight is not None else None
        return layout if layout is not None and layout.num_segments else None

    # ------------------------------------------------------------------------------------------------ both sets

    def forward(self, q, k, v):
        """(out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] float32, float64 for float64 inputs)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        # What the host reads is queued first: the largest magnitudes (for inclusion-exclusion on bf16) and the
        # layouts' sorts, each ending in one read of its sizes. Each read then waits only for the work queued before
        # it, not for the window kernel queued next, which needs no layout and fills the device while the host waits
        # for those reads and launches the group set. (On a side stream, beside the group set, it measured slower:
        # v13 in benchmarks/results/focus_h200/NOTES.md.)
        if self.subtracts and q.dtype == torch.bfloat16:
            # Three rounded partials enter the merge (two with weight about 1): bf16 inputs run the calls on float16
            # copies, whose outputs carry 3 more bits. Decided before the pair layout's read: when no token turns
            # out to be in two groups, nothing is subtracted and the copies only cost their passes.
            finish_calls = CallInputs.queue_half_copies(q, k, v, self.scale)
        else:
            finish_calls = functools.partial(CallInputs.plain, self.scale)
        self._queue_sorts()
        if self.window_kernel is not None:
            # With one membership per token in q's dtype, as the group set's partial: the merge reads half the bytes
            # of float32, and a convex combination of two partials rounded once each errs no more than the larger of
            # their roundings (before the result's own rounding). Several memberships: float32 (three partials).
            base = self.window_kernel.forward(q, k, v, dtype if self.multi else q.dtype)
        elif self.blocks:
            base = None  # masked calls, after the group set's
        else:  # an empty partial: lse -inf, so its values are never weighed
            base = q.new_zeros(q.shape), q.new_full(q.shape[:3], float("-inf"), dtype=dtype)
        calls = finish_calls()  # waits for the magnitudes' read (bf16 inclusion-exclusion)
        out_s, lse_s = self._group_forward(q, k, v, calls)
        if base is None:
            base = self._window_forward(q, k, v)
        result = torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:3], dtype=dtype)
        if not self.multi:
            return merge_indexed(*base, out_s, lse_s, self.sorted.token_slot, result)
        subtracted = None
        if self.pairs is not None:
            subtracted = (*self._pair_forward(q, k, v, calls), self.pairs.entry_slots())
        return merge_indexed(*base, out_s, lse_s, self.sorted.entry_slots(), result, subtracted=subtracted,
                             part_unit=calls.value_unit)

    def backward(self, q, k, v, out, lse, grad_out):
        """(dq, dk, dv) in the inputs' dtypes, from the final out and lse of :meth:`forward`. After an
        inclusion-exclusion forward, each pair once: the Triton kernels' backward on CUDA, masked calls elsewhere."""
        if self.subtracts and q.device.type == "cuda":
            from .triton_prefill import backward_of_pattern  # it imports this module
            return backward_of_pattern(self.groups, q, k, v, out, lse, grad_out, window=self.window,
                                       causal=self.causal, scale=self.scale)
        grads = self._group_backward(q, k, v, out, lse, grad_out)
        if self.window_kernel is not None:
            grads = self.window_kernel.backward(q, k, v, out, lse, grad_out, grads)
        elif self.blocks:
            grads = [g + w for g, w in zip(grads, self._window_backward(q, k, v, out, lse, grad_out))]
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

    # ------------------------------------------------------------------------------------------------ group set

    def _group_calls(self) -> Iterator[tuple[int, int, int, int]]:
        """(index, r0, r1, keys) of the masked same-group calls: query slots [r0, r1) of every segment against key
        slots [0, keys)."""
        rows = max(16, MASK_ELEMENTS // (self.sorted.num_segments * self.sorted.length) // 16 * 16)
        for index, r0 in enumerate(range(0, self.sorted.length, rows)):
            r1 = min(self.sorted.length, r0 + rows)
            yield index, r0, r1, r1 if self.causal else self.sorted.length

    def _group_mask(self, slot_tokens, r0: int, r1: int, keys: int) -> torch.Tensor:
        """[S, 1, r1 - r0, keys] bool: real slots, causal in slot order (= position order within a segment), and
        with several memberships only pairs sharing no group below the segment's."""
        q_tok, k_tok = slot_tokens[:, r0:r1], slot_tokens[:, :keys]
        allowed = (q_tok >= 0)[:, :, None] & (k_tok >= 0)[:, None, :]
        if self.causal:
            device = slot_tokens.device
            allowed &= torch.arange(keys, device=device)[None, :] <= torch.arange(r0, r1, device=device)[:, None]
        if self.multi:
            allowed &= ~self.sets.shared(q_tok, k_tok, below=self.sorted.segment_group)
        return allowed[:, None]

    def _group_forward(self, q, k, v, calls: CallInputs):
        """Partial results of the group set in the sorted layout: (out [S, Hq, L, D], lse [S, Hq, L]), of the inputs
        as ``calls`` says."""
        q_s, k_s, v_s = calls.pack(self.sorted, q, k, v)
        scale = calls.scale
        if self.fast:
            self.causal_family, out_s, lse_s, self.saved["group"] = causal_call(q_s, k_s, v_s, scale)
        else:
            slot_tokens, outs, lses = self.sorted.slot_tokens(), [], []
            for index, r0, r1, keys in self._group_calls():
                allowed = self._group_mask(slot_tokens, r0, r1, keys)
                out, lse, self.saved[("group", index)] = self.masked.forward(
                    q_s[:, :, r0:r1], k_s[:, :, :keys], v_s[:, :, :keys], allowed, scale)
                out, lse = _clear_empty(out, lse, allowed)
                outs.append(out)
                lses.append(lse)
            out_s, lse_s = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        return out_s, lse_s

    def _group_backward(self, q, k, v, out, lse, grad_out):
        """The group set's share of (dq, dk, dv), float32 [B, H, T, D] (float64 for float64 inputs)."""
        q_s, k_s, v_s, grad_s, out_s, lse_s = (self.sorted.pack(t) for t in (q, k, v, grad_out, out, lse))
        if self.fast and not self.subtracts:
            grads = self.causal_family.backward(grad_s, q_s, k_s, v_s, out_s, lse_s, None, self.saved["group"],
                                                self.scale)
        else:
            slot_tokens, dqs = self.sorted.slot_tokens(), []
            dtype = lse.dtype
            dk_s, dv_s = k_s.new_zeros(k_s.shape, dtype=dtype), v_s.new_zeros(v_s.shape, dtype=dtype)
            for index, r0, r1, keys in self._group_calls():
                dq, dk, dv = self.masked.backward(
                    grad_s[:, :, r0:r1], q_s[:, :, r0:r1], k_s[:, :, :keys], v_s[:, :, :keys], out_s[:, :, r0:r1],
                    lse_s[:, :, r0:r1], self._group_mask(slot_tokens, r0, r1, keys),
                    self.saved.get(("group", index)), self.scale)  # the CPU op saves nothing
                dqs.append(dq)
                dk_s[:, :, :keys] += dk
                dv_s[:, :, :keys] += dv
            grads = torch.cat(dqs, dim=2), dk_s, dv_s
        return [self.sorted.to_tokens(g, lse.dtype) for g in grads]

    def _pair_forward(self, q, k, v, calls: CallInputs):
        """Partial results of the pairs the group calls count twice, in the layout of :attr:`pairs`: (out [P, Hq,
        L, D], lse [P, Hq, L]), one batched causal call of the inputs as ``calls`` says."""
        _, out, lse, _ = causal_call(*calls.pack(self.pairs, q, k, v), calls.scale)  # no backward needed
        return out, lse

    # ------------------------------------------------------------------------------------------------ window set

    def _window_mask(self, b0: int, b1: int, device) -> torch.Tensor:
        """[B * n, 1, P, P + W] bool: the window set's pairs among blocks b0..b1-1 (real positions, 0 <= i - j <=
        window, no shared group)."""
        blocks, length = self.blocks, self.length
        q_pos = torch.arange(b0 * blocks.block, b1 * blocks.block, device=device).view(b1 - b0, blocks.block)
        k_pos = q_pos[:, :1] - blocks.reach + torch.arange(blocks.block + blocks.reach, device=device)
        distance = q_pos[:, :, None] - k_pos[:, None, :]
        q_real, k_real = q_pos < length, (k_pos >= 0) & (k_pos < length)
        local = (distance >= 0) & (distance <= self.window) & q_real[:, :, None] & k_real[:, None, :]
        offsets = torch.arange(self.batch, device=device)[:, None, None] * length
        q_tok = torch.where(q_real, q_pos + offsets, -1).flatten(0, 1)
        k_tok = torch.where(k_real, k_pos + offsets, -1).flatten(0, 1)
        allowed = local.repeat(self.batch, 1, 1) & ~self.sets.shared(q_tok, k_tok)
        return allowed[:, None]

    def _window_forward(self, q, k, v):
        """Partial results of the window set by masked calls: (out [B, Hq, T, D], lse [B, Hq, T])."""
        blocks = self.blocks
        q_pad, k_pad, v_pad = blocks.pad_queries(q), blocks.pad_keys(k), blocks.pad_keys(v)
        outs, lses = [], []
        for index, (b0, b1) in enumerate(blocks.calls()):
            allowed = self._window_mask(b0, b1, q.device)
            out, lse, self.saved[("window", index)] = self.masked.forward(
                blocks.query_blocks(q_pad, b0, b1), blocks.key_blocks(k_pad, b0, b1),
                blocks.key_blocks(v_pad, b0, b1), allowed, self.scale)
            out, lse = _clear_empty(out, lse, allowed)
            outs.append(blocks.unblock(out, self.batch))
            lses.append(blocks.unblock(lse, self.batch))
        return torch.cat(outs, dim=2)[:, :, :self.length], torch.cat(lses, dim=2)[:, :, :self.length]

    def _window_backward(self, q, k, v, out, lse, grad_out):
        """The window set's share of (dq, dk, dv), float32 [B, H, T, D] (float64 for float64 inputs)."""
        blocks, dtype = self.blocks, lse.dtype
        q_pad, grad_pad, out_pad, lse_pad = (blocks.pad_queries(t) for t in (q, grad_out, out, lse))
        k_pad, v_pad = blocks.pad_keys(k), blocks.pad_keys(v)
        dk_pad, dv_pad = k_pad.new_zeros(k_pad.shape, dtype=dtype), v_pad.new_zeros(v_pad.shape, dtype=dtype)
        dqs = []
        for index, (b0, b1) in enumerate(blocks.calls()):
            dq, dk, dv = self.masked.backward(
                blocks.query_blocks(grad_pad, b0, b1), blocks.query_blocks(q_pad, b0, b1),
                blocks.key_blocks(k_pad, b0, b1), blocks.key_blocks(v_pad, b0, b1),
                blocks.query_blocks(out_pad, b0, b1), blocks.query_blocks(lse_pad, b0, b1),
                self._window_mask(b0, b1, q.device), self.saved[("window", index)], self.scale)
            dqs.append(blocks.unblock(dq.to(dtype), self.batch))
            blocks.add_key_blocks(dk_pad, dk, b0, b1)
            blocks.add_key_blocks(dv_pad, dv, b0, b1)
        keys = slice(blocks.reach, blocks.reach + self.length)
        return torch.cat(dqs, dim=2)[:, :, :self.length], dk_pad[:, :, keys], dv_pad[:, :, keys]
