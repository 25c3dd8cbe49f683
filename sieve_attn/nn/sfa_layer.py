"""SFA attached to one attention layer: sparse q and k, and the output-matching term of dense-to-SFA conversion."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._checks import fail
from ..config import SFAConfig, sfa_decode_backend
from ..ops.blockwise import blockwise_attention
from ..ops.sfa.attention import sfa_attention
from ..ops.sfa.cache import SFAKeyCache
from ..ops.sfa.codes import densify, sparsify
from ..ops.sfa.decode import sfa_decode


class CachedKeys:
    """The keys of one attention layer held in an :class:`~sieve_attn.ops.sfa.cache.SFAKeyCache`: what
    :class:`sieve_attn.SFACache` hands the attention function in place of the dense keys [B, Hkv, Tk, D].

    ``cache`` already holds this call's Tq tokens: Tk = len(cache), and query i sits at cache position Tk - Tq + i.
    ``new`` is the dense keys [B, Hkv, Tq, D] of this call's tokens when the cache held none before it (a prompt,
    Tk == Tq), else None. Any other attribute raises AttributeError: only :meth:`SFALayer.attend` reads these keys.
    """

    __slots__ = ("cache", "new")

    def __init__(self, cache: SFAKeyCache, new: Optional[torch.Tensor] = None):
        self.cache, self.new = cache, new

    def dense(self) -> torch.Tensor:
        """Keys k [B, Hkv, Tk, D] for the dense-key path: ``new`` when set, else the cached codes zero-filled
        (densified, a transient tensor). Either way sparsify(k, topk) is the sparse keys of the dense path, which
        is all SFA reads of k."""
        return self.new if self.new is not None else densify(*self.cache.keys(), self.cache.head_dim)

    def __getattr__(self, name: str):
        # Reached only for missing attributes: model code other than the sieve attention function touched the keys.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"keys held by a sieve_attn.SFACache have no attribute {name!r}: they can only be read "
                             "by the 'sieve_focus' attention function of a model composed with an SFAConfig")


class SFALayer(nn.Module):
    """Computes one attention layer with Sparse Feature Attention (no parameters of its own).

    While ``matching`` is on and autograd is recording, each call also computes the layer's dense attention output
    without gradient and records mean((O_sfa - O_dense)^2) over batch, heads, tokens and features in
    ``matching_terms``: the paper's output-matching regulariser (Eq. 8), averaged over heads.
    """

    def __init__(self, config: SFAConfig):
        super().__init__()
        self.config = config
        # The top-k in use: config.topk, except while fine-tuning warms it up from the head dim
        # (FinetuneSettings.topk_warmup).
        self.topk = config.topk
        self.matching = False
        self.matching_terms: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        return f"topk={self.topk}"

    def attend(self, q, k, v, *, attn_mask=None, scale=None, softcap=None, focus=None) -> torch.Tensor:
        """Attention output [B, Hq, Tq, D] with SFA scores; with ``focus`` (the layer's
        :class:`~sieve_attn.nn.focus_layer.FocusLayer`), over the Focus pattern: the sparse q and k go through
        Focus's own op, so its backends compute SFA scores exactly (pairs sharing no coordinate score 0).

        k is dense [B, Hkv, Tk, D] or :class:`CachedKeys`. Cached keys whose cache held tokens before this call are
        read by :func:`~sieve_attn.ops.sfa.decode.sfa_decode` (their codes only) when the call is plain causal SFA:
        no ``attn_mask`` (transformers passes none without padding, on a full-attention layer or on a sliding one
        still within its window), no ``softcap`` and no ``focus``. Otherwise :meth:`CachedKeys.dense` gives the
        dense-key path keys of the same sparse form, so the result is the same."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if isinstance(k, CachedKeys):
            self._check_cached(k)
            if k.new is None and attn_mask is None and softcap is None and focus is None:
                return sfa_decode(q, k.cache, scale=scale, backend=sfa_decode_backend(self.config.backend))[0]
            k = k.dense()
        target = self._dense_target(q, k, v, attn_mask, scale, softcap)
        topk = self.topk
        if focus is not None:
            out = focus.attend(sparsify(q, topk), sparsify(k, topk), v, attn_mask=attn_mask, scale=scale,
                               softcap=softcap)
        else:
            out = sfa_attention(q, k, v, topk=topk, scale=scale, softcap=softcap, attn_mask=attn_mask,
                                backend=self.config.backend)
        if target is not None:
            self.matching_terms.append((out.float() - target.float()).pow(2).mean())
        return out

    def _check_cached(self, k: CachedKeys) -> None:
        if k.cache.topk != self.config.topk:
            fail("past_key_values", f"an SFACache built for this model (topk {self.config.topk})",
                 f"one whose keys keep topk {k.cache.topk} coordinates")
        if self.matching and torch.is_grad_enabled():
            fail("past_key_values", "no SFACache while the output-matching term is recorded (it needs dense keys)",
                 "an SFACache")

    def _dense_target(self, q, k, v, attn_mask, scale, softcap) -> Optional[torch.Tensor]:
        if not (self.matching and torch.is_grad_enabled()):
            return None
        with torch.no_grad():
            return blockwise_attention(q, k, v, scale=scale, causal=True, softcap=softcap, attn_mask=attn_mask)[0]
