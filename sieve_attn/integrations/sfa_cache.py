"""A transformers ``Cache`` that stores SFA's compressed keys: ``model.generate(..., cache=SFACache(model))``.

Each layer keeps an :class:`~sieve_attn.ops.sfa.cache.SFAKeyCache` (per token and KV head: the key's ``topk``
(index, value) pairs and the dense V row) and no dense keys. Its ``update`` returns, as key_states, a
:class:`~sieve_attn.nn.sfa_layer.CachedKeys` that the model code hands unchanged to the ``"sieve_focus"`` attention
function (Llama/SmolLM2, Mistral, Qwen2, Qwen3, OLMo-2, GPT-2 and Gemma-2 all call ``cache.update`` and then the
attention function on what it returned); :meth:`SFALayer.attend <sieve_attn.nn.sfa_layer.SFALayer.attend>` decides
how to read them.
"""
from __future__ import annotations

import copy
import operator
from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .._checks import check_int, fail
from ..nn.sfa_layer import CachedKeys, SFALayer
from ..ops.sfa.cache import SFAKeyCache
from .transformers import (ATTENTION_NAME, SFA_ATTR, attention_modules, head_dim, in_autocast_dtype, kv_heads,
                           layer_windows)


class SFACacheLayer(CacheLayerMixin):
    """One attention layer of :class:`SFACache`: the compressed keys and dense values of its most recent tokens.

    A full-attention layer (``window`` None) keeps every token. A sliding-window layer (transformers' convention:
    the query at position p attends keys p - window < j <= p) keeps at least the last window - 1 tokens, which is
    all the next queries can see, and at most 2 * window - 1: once it holds 2 * window, it drops the older ones
    (one copy of window - 1 tokens every window + 1 tokens, so O(1) copies per token). While it records the past
    (:meth:`activate_past_recording`, which assisted generation calls so that it can take back rejected draft
    tokens) it drops old tokens only in :meth:`crop`, after the rejected ones went: the bound then holds only
    after each crop. Recording lasts until :meth:`reset` (transformers never ends it; ``record_past = False``
    does): a later plain generate over the same cache, which never crops, keeps every token, as transformers'
    own sliding layers do.

    ``keys`` and ``values`` (transformers' dense tensors) stay None; ``store`` is the SFAKeyCache, None until the
    first update, and ``seen`` counts the tokens of the sequence so far (store holds the last len(store) of them).
    """

    def __init__(self, sfa: SFALayer, kv_heads: int, head_dim: int, window: Optional[int] = None,
                 capacity: int = 256):
        super().__init__()
        self.sfa, self.topk = sfa, sfa.config.topk
        self.kv_heads, self.head_dim, self.window, self.capacity = kv_heads, head_dim, window, capacity
        self.is_sliding = window is not None
        self.store: Optional[SFAKeyCache] = None
        self.seen = 0
        self.rows_version = 0  # how often the batch rows were reordered, selected or repeated (Focus checks it)
        self.record_past = False

    def __deepcopy__(self, memo):
        # copy.deepcopy of a cache (transformers' way to reuse a prompt's cache) copies the codes; the copy still
        # belongs to the same model, so the SFA layer is shared, not copied.
        memo[id(self.sfa)] = self.sfa
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.store = self._empty_store(key_states.shape[0], key_states.dtype, key_states.shape[2])
        self.is_initialized = True

    def _empty_store(self, batch: int, dtype: torch.dtype, tokens: int) -> SFAKeyCache:
        return SFAKeyCache(batch, self.kv_heads, self.head_dim, topk=self.topk, dtype=dtype, device=self.device,
                           capacity=max(self.capacity, tokens))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stores key_states [B, Hkv, Tq, D] (after RoPE), mapped by the layer's feature map
        (:meth:`SFALayer.map_keys`), as codes and value_states [B, Hkv, Tq, D] as they are.

        Returns (:class:`CachedKeys` of the layer's store, the store's V [B, Hkv, Tk, D]), Tk = tokens held now."""
        if key_states.dim() != 4 or (key_states.shape[1], key_states.shape[3]) != (self.kv_heads, self.head_dim):
            fail("past_key_values", "an SFACache built for this model", f"one built for {self.kv_heads} KV heads of "
                 f"dim {self.head_dim}, given keys of shape {tuple(key_states.shape)}")
        key_states, value_states = in_autocast_dtype(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.store
        key_states = self.sfa.map_keys(key_states)
        keys = CachedKeys(store, self.sfa, key_states if len(store) == 0 else None)
        store.append(key_states, value_states)
        self.seen += key_states.shape[2]
        if not self.record_past:
            # The returned keys still read the old store, whose tokens this call's queries need.
            self._drop_old_tokens()
        return keys, store.values()

    def _drop_old_tokens(self) -> None:
        """A sliding-window layer holding 2 * window tokens or more keeps the last window - 1."""
        if self.window is not None and len(self.store) >= 2 * self.window:
            self._rebuild(start=len(self.store) - self.window + 1)

    def activate_past_recording(self, **kwargs) -> None:
        """From now on a sliding-window layer drops old tokens only in :meth:`crop` (transformers' assisted
        generation calls this before it feeds draft tokens, then crops the rejected ones after every step), so that
        a crop can take back every token since the last one."""
        self.record_past = True

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can take back any of the tokens held, which assisted generation asks before it
        starts (it crops rejected draft tokens): always for a full-attention layer or one that records the past;
        for another sliding-window layer only until it first drops old tokens (later, crop refuses to cut into the
        window - 1 the next query sees)."""
        return self.window is None or self.record_past or self.seen == self._held()

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next call's keys: the tokens held plus the query_length new ones, the
        first at absolute position kv_offset."""
        held = self._held()
        return held + query_length, self.seen - held

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def reset(self) -> None:
        self.store, self.seen, self.is_initialized, self.record_past = None, 0, False, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the batch rows ``indices`` (int64 ids, repeats allowed, or a bool mask [B]), in that order."""
        if self.store is not None:
            self._rebuild(rows=indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self._rebuild(rows=torch.arange(self.store.batch, device=self.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove tokens (transformers' convention: a count <= 0). A sliding-window layer
        that already dropped old tokens must keep the window - 1 that the next token's query sees. A layer that holds
        nothing yet has nothing to drop (as transformers' DynamicLayer; with KV sharing a layer may never fill)."""
        if self.store is None:
            return
        held = self._held()
        removable = held if self.seen == held else held - (self.window - 1)
        count = _integer(tokens_to_remove)
        if count is None or not -removable <= count <= 0:
            kept = "" if self.seen == held else (f"; this sliding-window layer dropped its oldest tokens and keeps "
                                                 f"the {self.window - 1} that the next query sees")
            fail("tokens_to_remove", f"{'0' if not removable else f'an int in [-{removable}, 0]'} (tokens to drop "
                                     f"from the end{kept})", tokens_to_remove)
        tokens_to_remove = count
        if tokens_to_remove:
            self._rebuild(stop=held + tokens_to_remove)
            self.seen += tokens_to_remove
        self._drop_old_tokens()

    def _held(self) -> int:
        return 0 if self.store is None else len(self.store)

    def _rebuild(self, rows: Optional[torch.Tensor] = None, start: int = 0, stop: Optional[int] = None) -> None:
        """Replaces the store by a new one holding its tokens [start, stop) of the batch rows ``rows`` (all by
        default), copying the codes (never recoding the keys)."""
        indices, values = self.store.keys(start, stop)
        v = self.store.values()[:, :, start:stop]
        if rows is not None:
            self.rows_version += 1
            rows = rows.to(self.device)
            indices, values, v = indices[rows], values[rows], v[rows]
        self.store = self._empty_store(v.shape[0], v.dtype, v.shape[2])
        if v.shape[2]:
            self.store.append_codes(indices, values, v)


def _integer(count) -> Optional[int]:
    """count as a Python int if it is an integer (an int, or an integer 0-dim tensor such as the counts assisted
    generation computes in some transformers versions), else None. Booleans are not counts."""
    if isinstance(count, bool) or (isinstance(count, torch.Tensor) and count.dtype == torch.bool):
        return None
    try:
        return operator.index(count)
    except TypeError:
        return None


class SFACache(Cache):
    """KV cache of a model composed with an :class:`~sieve_attn.SFAConfig`, holding SFA's compressed keys.

    ``model.generate(ids, cache=SFACache(model), ...)``, or ``model(ids, cache=cache)`` for one forward
    (``past_key_values=`` before transformers 5.2x renamed the argument ``cache``): every attention layer
    keeps, per token and KV head, the key's ``topk`` coordinate indices and values (the codes SFA scores with) and
    the dense V row, in an :class:`~sieve_attn.ops.sfa.cache.SFAKeyCache` (``layers[i].store``); no dense key is
    kept. Per token and KV head that is ``layers[i].store.bytes_per_token()`` (302 bytes at head dim 128, topk 16,
    bfloat16) against ``dense_bytes_per_token(head_dim, dtype)`` = 2 * head_dim * element size (512) for
    transformers' DynamicCache; :meth:`allocated_bytes` measures the whole cache.

    What a forward computes is what the model computes with a dense cache (same SFA attention, same tokens under
    greedy decoding; float rounding may differ):

    - a call on an empty layer (the prompt) attends with the new dense keys, exactly as without this cache;
    - a call that extends a layer (a decode step, or a prompt chunk after the first) reads the codes through
      :func:`~sieve_attn.sfa_decode` when transformers passes no attention mask (no padding, and a full-attention
      layer or a sliding one still within its window), the layer has no softcap (Gemma-2 has one) and no Focus
      router; otherwise (left padding, chunked prefill, a sliding layer past its window, Gemma-2, Focus + SFA) it
      densifies the layer's cached codes for that call and runs the ordinary path with the mask.

    Sliding-window layers (from the model config, as transformers' DynamicCache reads it) keep between window - 1
    and 2 * window - 1 tokens (:class:`SFACacheLayer`). Beam search (``reorder_cache``), ``batch_select_indices``,
    ``batch_repeat_interleave``, ``crop`` (a negative count; so assisted and prompt-lookup generation, see
    :attr:`SFACacheLayer.is_croppable`), ``reset`` and ``copy.deepcopy`` (a copy for the same model) are
    supported; ``torch.compile`` of the decode step and offloading are not.

    Args:
        model: a transformers decoder composed with an SFAConfig (alone or with a FocusConfig), still running the
            ``"sieve_focus"`` attention implementation that compose set.
        capacity: tokens each layer allocates at first (at least the first call's tokens); a layer doubles its
            capacity whenever an append does not fit.

    The cache is bound to the SFA layers of the model it was built for, whose top-k and feature maps code its keys:
    a layer receiving keys of another head count or head dim, a layer index past the model's layers, or any other
    model's attention reading it raises ValueError naming
    ``past_key_values``; so do a model not composed with SFA or one switched to another attention implementation
    (``model``).
    """

    def __init__(self, model: nn.Module, *, capacity: int = 256):
        super().__init__(layers=_cache_layers(model, check_int("capacity", capacity, 1)))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            fail("past_key_values", "an SFACache built for this model",
                 f"one built for {len(self.layers)} attention layers, given layer {layer_idx}")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def allocated_bytes(self) -> int:
        """Bytes of every layer's SFAKeyCache (codes and V, unused capacity included); 0 before the first call."""
        return sum(layer.store.allocated_bytes() for layer in self.layers if layer.store is not None)


def _cache_layers(model: nn.Module, capacity: int) -> list[SFACacheLayer]:
    """One SFACacheLayer per attention layer of ``model``, with the window DynamicCache(config) gives the layer."""
    sfa = getattr(model, "sieve_sfa_config", None)
    if sfa is None:
        fail("model", "a model composed with an SFAConfig (sieve_attn.compose)",
             f"a {type(model).__name__} without SFA")
    implementation = model.config.get_text_config()._attn_implementation
    if implementation != ATTENTION_NAME:
        fail("model", f"the attention implementation {ATTENTION_NAME!r} that compose set", repr(implementation))
    windows = layer_windows(model)
    indices = [module.layer_idx for _, module in attention_modules(model)]
    if indices != list(range(len(windows))):
        fail("model", f"attention modules with layer_idx 0 .. {len(windows) - 1} (one per layer of its config)",
             indices)
    layers = [getattr(module, SFA_ATTR) for _, module in attention_modules(model)]
    return [SFACacheLayer(sfa_layer, kv_heads(model), head_dim(model), window, capacity)
            for sfa_layer, window in zip(layers, windows)]
