"""Greedy generation through a model's KV cache, with what the cache holds and a check against recomputation.

What ``sieve generate`` runs: a model composed with SFA decodes over an :class:`sieve_attn.SFACache` (the
compressed keys), any other model over transformers' DynamicCache.
"""
from __future__ import annotations

import inspect
import time

import torch

from .._checks import check_int, fail
from ..integrations.transformers import attention_modules, head_dim, kv_heads
from ..ops.sfa.cache import dense_bytes_per_token


def new_cache(model):
    """An empty KV cache for ``model``: :class:`sieve_attn.SFACache` when it is composed with SFA, else
    transformers' DynamicCache."""
    if getattr(model, "sieve_sfa_config", None) is not None:
        from ..integrations.sfa_cache import SFACache
        return SFACache(model)
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def cache_keyword(model) -> str:
    """The forward/generate keyword of a KV cache: ``cache`` in the transformers versions that renamed
    ``past_key_values`` (5.2x; they still take the old name, with a FutureWarning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def greedy_recompute(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """ids [1, T] followed by ``steps`` greedy tokens, each from a full forward of the whole sequence (no cache):
    what a KV cache must reproduce."""
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def greedy_continuation(model, ids: torch.Tensor, max_new_tokens: int, cache=None) -> torch.Tensor:
    """ids [1, T] followed by up to ``max_new_tokens`` greedy tokens, [1, T + new], from transformers' ``generate``
    through ``cache`` (default: a fresh :func:`new_cache`); fewer where an end-of-sequence token ends it, as
    transformers does."""
    cache = new_cache(model) if cache is None else cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, **{cache_keyword(model): cache})


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes allocated, bytes of the tokens held) of a KV cache: an SFACache's compressed stores (which allocate
    capacity ahead: :class:`sieve_attn.SFAKeyCache`), or the tensors of a DynamicCache's layers (both the same)."""
    if hasattr(cache, "allocated_bytes"):
        stores = [layer.store for layer in cache.layers if layer.store is not None]
        held = sum(store.bytes_per_token() * store.batch * store.kv_heads * len(store) for store in stores)
        return cache.allocated_bytes(), round(held)
    dense = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                if t is not None)
    return dense, dense


def generate(model, tokenizer, prompt: str, max_new_tokens: int, *, check: bool = False) -> dict:
    """Greedy continuation of ``prompt`` (batch 1) by ``max_new_tokens`` tokens through :func:`new_cache`.

    Returns {"prompt_tokens", "new_tokens", "text" (the continuation alone), "seconds" (wall time of generate),
    "tokens_per_s", "cache": {"kind", "allocated_bytes", "held_bytes" (:func:`cache_bytes`), "dense_bytes" (a
    dense K+V cache of the same tokens in the model's dtype, every layer and KV head)}, "equals_recomputation"
    (with ``check``: whether :func:`greedy_recompute` gives the same tokens; else None)}. Generation stops early
    at an end-of-sequence token, as transformers does."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    if ids.shape[1] == 0:
        fail("prompt", "text of at least one token", repr(prompt))
    cache = new_cache(model)
    started = time.perf_counter()
    out = greedy_continuation(model, ids, max_new_tokens, cache)
    seconds = time.perf_counter() - started
    new = out.shape[1] - ids.shape[1]
    # The cache holds every token but the last generated one (generate never feeds it back).
    per_token = len(attention_modules(model)) * kv_heads(model) * dense_bytes_per_token(head_dim(model), model.dtype)
    dense = (out.shape[1] - 1) * per_token
    same = torch.equal(out, greedy_recompute(model, ids, new)) if check else None
    return {"prompt_tokens": ids.shape[1], "new_tokens": new,
            "text": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True),
            "seconds": seconds, "tokens_per_s": new / seconds,
            "cache": {"kind": type(cache).__name__, **dict(zip(("allocated_bytes", "held_bytes"), cache_bytes(cache))),
                      "dense_bytes": dense},
            "equals_recomputation": same}
