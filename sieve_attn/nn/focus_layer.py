"""Focus attached to one attention layer: router, routing of cached tokens, and the attention it computes."""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch
from torch import nn

from .._checks import fail
from ..config import FocusConfig
from ..ops.blockwise import blockwise_attention
from ..ops.focus.attention import focus_attention, focus_soft_attention
from ..ops.focus.groups import FocusGroups
from ..ops.focus.reference import count_attended_pairs
from ..ops.focus.routing import causal_log_assign, document_starts, hard_groups, sink_positions, with_sinks_soft
from .router import FocusRouter


class FocusLayer(nn.Module):
    """Routes the tokens of one attention layer and computes its attention in the configured mode.

    Protocol, per forward pass of the host attention module: :meth:`observe` receives the layer's input hidden
    states [B, Tq, hidden] (the router's input) and the absolute position of the first of them (the number of
    tokens already in the KV cache), then :meth:`attend` receives q [B, Hq, Tq, D] and k, v [B, Hkv, Tk, D]. When
    Tk > Tq the first Tk - Tq keys come from a KV cache (a sliding-window cache may hold fewer than all earlier
    tokens); their routing is remembered from the passes that produced them, and since routing is causal it is
    what a full recomputation would give.
    """

    def __init__(self, hidden_size: int, config: FocusConfig):
        super().__init__()
        self.config = config
        self.router = FocusRouter(hidden_size, config)
        self.count_pairs = False
        self.pair_counts = [0, 0]  # attended, candidates (hard mode, while count_pairs is on)
        self._pending: Optional[_Pass] = None
        # The routing of the tokens a KV cache holds lives on the cache (see _kept), so that a copy of the cache
        # (copy.deepcopy, to reuse a prompt's prefill) carries it; a change of settings that invalidates it bumps
        # this count, and routing kept under another count is ignored.
        self._routing_version = 0

    def __getstate__(self) -> dict:
        """Pickling (``torch.save(model)``, multiprocessing) keeps the router and settings, not a pass in flight."""
        return dict(self.__dict__, _pending=None)

    def extra_repr(self) -> str:
        return f"mode={self.config.mode!r}, window={self.config.window}, top_k={self.config.top_k}"

    def reconfigure(self, **changes) -> None:
        """Changes inference settings (mode, top_k, window, sink_tokens, ...); the router's shape is fixed. The
        routing kept for cached tokens is forgotten unless only window, backend or the gate changed."""
        unknown = sorted(set(changes) - {f.name for f in fields(FocusConfig)})
        if unknown:
            fail(unknown[0], f"one of FocusConfig's settings ({', '.join(f.name for f in fields(FocusConfig))})",
                 "a name FocusConfig does not have")
        fixed = {"num_groups", "group_dim"} & set(changes)
        if fixed:
            raise ValueError(f"{sorted(fixed)[0]}: expected the router's own value, got a change (retrain instead)")
        self.config = replace(self.config, **changes)
        self.router.config = self.config
        if set(changes) - _PATTERN_ONLY:  # the routing kept for cached tokens no longer holds
            self._routing_version += 1

    def observe(self, hidden_states: torch.Tensor, start: Optional[int] = None, cache=None,
                rows: Optional[Callable[[], object]] = None) -> None:
        """Routes the tokens of this pass: hidden_states [B, Tq, hidden] at absolute positions start.. (None: the
        keys of :meth:`attend` are the whole sequence so far, so start = Tk - Tq). ``cache``: the KV cache the
        pass extends (None: none), whose earlier tokens' routing this layer remembered from the passes that wrote
        them. ``rows()``: a token of the cache's batch rows that changes when something between passes reorders,
        selects or repeats them (beam search) and not when tokens are appended or cropped; None where the cache
        cannot tell."""
        if self.config.mode == "dense":
            self._pending = None
            return
        self._pending = _Pass(self.router(hidden_states), start, cache, None if rows is None else rows(), rows)

    def follow_rows(self, cache, indices: torch.Tensor, rows: Optional[Callable[[], object]] = None) -> None:
        """The cache's batch rows became its former rows ``indices`` ([B'] indices, e.g. beam search's beam_idx):
        the routing kept for its tokens follows. ``rows()`` reads the cache's rows token after the reordering (see
        :meth:`observe`). A cache this layer keeps no routing for is left alone."""
        past = self._kept(cache)
        if past is None:
            return
        routing = past.routing
        routing = routing.rows(indices) if isinstance(routing, FocusGroups) else \
            routing.index_select(0, indices.to(routing.device))
        sink_starts = None if past.sink_starts is None else [past.sink_starts[i] for i in indices.tolist()]
        self._keep(cache, _Routed(routing, None if rows is None else rows(), past.length, sink_starts))

    def attend(self, q, k, v, *, attn_mask=None, scale=None, softcap=None) -> torch.Tensor:
        """Attention output [B, Hq, Tq, D] for the current mode (queries aligned to the end of the keys)."""
        cfg = self.config
        if cfg.mode == "dense":
            return blockwise_attention(q, k, v, scale=scale or q.shape[-1] ** -0.5, causal=True, softcap=softcap,
                                       attn_mask=attn_mask)[0]
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("FocusLayer.attend: the router has not seen this pass's hidden states; "
                               "the host attention module must be composed with sieve_attn.compose")
        logits = pending.logits
        q_len, k_len = q.shape[2], k.shape[2]
        start = k_len - q_len if pending.start is None else pending.start
        sink_starts = self._sink_starts(pending, start, attn_mask, q_len, k_len)
        sinks = sink_positions(logits.shape[0], start, q_len, cfg.sink_tokens, logits.device, sink_starts)
        if cfg.mode == "train":
            causal = cfg.train_routing == "causal"
            if k_len != q_len and not causal:
                raise RuntimeError("Focus mode 'train' routes with Sinkhorn over the whole sequence and cannot "
                                   "extend a KV cache; use mode 'soft' or 'hard' to generate")
            current = with_sinks_soft(self.router.training_assign(logits, causal), sinks)
            assign = self._routing_of_keys(current, start, k_len, pending, sink_starts)
        elif cfg.mode == "soft":
            current = with_sinks_soft(causal_log_assign(logits, self.router.group_bias).exp(), sinks)
            assign = self._routing_of_keys(current, start, k_len, pending, sink_starts)
        else:
            ids = hard_groups(logits, self.router.group_bias, cfg.top_k, sinks)
            groups = self._routing_of_keys(FocusGroups.routed(ids, cfg.num_groups), start, k_len, pending,
                                           sink_starts)
            if self.count_pairs:
                attended, candidates = count_attended_pairs(groups.ids, cfg.window, q_len=q_len)
                self.pair_counts[0] += attended
                self.pair_counts[1] += candidates
            return focus_attention(q, k, v, groups, window=cfg.window, scale=scale, softcap=softcap,
                                   attn_mask=attn_mask, backend=cfg.backend)
        return focus_soft_attention(q, k, v, assign, window=cfg.window, gate=cfg.gate, gate_lambda=cfg.gate_lambda,
                                    scale=scale, softcap=softcap, attn_mask=attn_mask)

    def _sink_starts(self, this_pass: "_Pass", start: int, attn_mask, q_len: int, k_len: int) -> Optional[list]:
        """Each row's document starts (the sinks start there; :func:`~sieve_attn.ops.focus.routing.document_starts`),
        None where every row has one, at 0: those of the tokens before this pass (kept with the cache's routing)
        and those ``attn_mask`` shows in this pass (two host reads per layer and pass of more than one token, and in
        a one-token pass while some row has not begun: a decode step then continues its row's last document). The
        read also refuses a mask Focus cannot follow (a tree of draft tokens), with sink tokens or without."""
        past = None if not (start and self.config.sink_tokens) else self._kept(this_pass.cache)
        earlier = None if past is None else past.sink_starts
        # A decode step reads nothing once every row has begun; while a row has seen only pads (a left-padded
        # prompt fed token by token), its start may come in this one token.
        begun = earlier is None or all(earlier)
        if attn_mask is None or (q_len == 1 and (start and begun or not self.config.sink_tokens)):
            return earlier
        found = document_starts(attn_mask, start, k_len)
        if not self.config.sink_tokens:
            return None
        batch = this_pass.logits.shape[0]
        found = found * (batch // len(found))  # a mask shared by the rows: the same starts in each
        if start:
            found = [before + now for before, now in zip(earlier or [[0]] * batch, found)]
        return None if all(row == [0] for row in found) else found

    def _routing_of_keys(self, current, start: int, k_len: int, this_pass: "_Pass", sink_starts: Optional[list]):
        """Routing of the keys present, given the routing ``current`` of the new tokens at absolute positions
        start.. : soft memberships [B, Tq, K] or hard :class:`FocusGroups`. The keys are the last k_len of the
        sequence: a sliding-window cache keeps only the most recent tokens, so routing is remembered for the whole
        sequence (per cache: ``this_pass.cache``, with the rows' ``sink_starts``) and sliced by absolute
        position."""
        history = current
        if start:
            past = self._kept(this_pass.cache)
            routing = None if past is None else past.routing
            known = None if routing is None else _length(routing)
            if known is None or _batch(routing) != _batch(current) or known < start or \
                    type(routing) is not type(current):
                rows = "" if routing is None or _batch(routing) == _batch(current) else (
                    "; rows repeated or selected by hand (batch_repeat_interleave, batch_select_indices) must go "
                    "through model._reorder_cache(cache, indices), which moves their routing too")
                seen = "none of them" if routing is None else \
                    f"{known} of this cache's (batch {_batch(routing)}, now {_batch(current)})"
                raise RuntimeError(f"FocusLayer: the KV cache holds {start} tokens but the router has seen {seen} "
                                   f"under the current Focus settings; run the whole prompt through the composed "
                                   f"model with this cache (the routing of cached tokens is kept with the cache, and "
                                   f"a change of the Focus settings forgets it){rows}")
            if this_pass.rows_before != past.rows and start >= past.length:
                raise RuntimeError("FocusLayer: the KV cache's batch rows were reordered, selected or repeated "
                                   "between passes other than by generate's beam search; the routing of the cached "
                                   "tokens cannot follow (reorder a composed model's cache with "
                                   "model._reorder_cache(cache, indices))")
            if isinstance(current, FocusGroups):
                history = routing.span(0, start).extend(current)
            else:
                history = torch.cat([routing[:, :start], current], dim=1)
        if this_pass.cache is not None:
            rows = None if this_pass.rows is None else this_pass.rows()  # after this pass appended its tokens
            kept = history if isinstance(history, FocusGroups) else history.detach()
            self._keep(this_pass.cache, _Routed(kept, rows, start + _length(current), sink_starts))
        return history.last(k_len) if isinstance(history, FocusGroups) else history[:, history.shape[1] - k_len:]

    def _kept(self, cache) -> Optional["_Routed"]:
        """The routing this layer kept for the tokens of ``cache`` under its current settings, or None (also for
        a cache pickled and loaded again: the layer it named is not known there)."""
        kept = None if cache is None else getattr(cache, _ROUTING_ATTR, {}).get(id(self))
        if kept is None or kept.owner is None or kept.owner() is not self or kept.version != self._routing_version:
            return None
        return kept

    def _keep(self, cache, routed: "_Routed") -> None:
        routed.owner, routed.version = weakref.ref(self), self._routing_version
        kept = getattr(cache, _ROUTING_ATTR, None)
        if kept is None:
            kept = {}
            setattr(cache, _ROUTING_ATTR, kept)
        kept[id(self)] = routed


# The attribute of a KV cache that holds its tokens' routing, per Focus layer (keyed by the layer's id; each entry
# names its layer by a weak reference, which copy.deepcopy keeps: a copied cache serves the same layers).
_ROUTING_ATTR = "_sieve_focus_routing"

# Settings that change how routed tokens attend, not how they are routed: a cache's routing survives them.
_PATTERN_ONLY = {"window", "backend", "gate", "gate_lambda"}


@dataclass
class _Pass:
    """What :meth:`FocusLayer.observe` hands :meth:`FocusLayer.attend`: the router logits of the pass's tokens,
    their start position, the cache, its rows token before the pass and how to read it again."""

    logits: torch.Tensor
    start: Optional[int]
    cache: object
    rows_before: object
    rows: Optional[Callable[[], object]]


@dataclass
class _Routed:
    """The routing of the tokens a cache holds (``length`` of them), its rows token when it was written, and each
    row's document starts (None: one, at 0, for every row)."""

    routing: object
    rows: object
    length: int
    sink_starts: Optional[list] = None
    owner: Optional[weakref.ref] = None  # the FocusLayer that kept it
    version: int = 0  # its _routing_version then

    def __getstate__(self) -> dict:
        """Pickling a cache keeps the routing but not the layer it belongs to (a weak reference cannot be)."""
        return dict(self.__dict__, owner=None)

    def __deepcopy__(self, memo: dict) -> "_Routed":
        """A copied cache's routing still belongs to the same layer (its owner stays)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update({name: value if name == "owner" else copy.deepcopy(value, memo)
                               for name, value in self.__dict__.items()})
        return clone


def _length(routing) -> int:
    return routing.length if isinstance(routing, FocusGroups) else routing.shape[1]


def _batch(routing) -> int:
    return (routing.ids if isinstance(routing, FocusGroups) else routing).shape[0]
