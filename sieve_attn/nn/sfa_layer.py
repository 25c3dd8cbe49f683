"""SFA attached to one attention layer: sparse q and k, and the output-matching term of dense-to-SFA conversion."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._checks import fail
from ..config import SFAConfig, sfa_decode_backend
from ..ops.blockwise import blockwise_attention
from ..ops.masked_sdpa import unmasked_sdpa
from ..ops.sfa.attention import sfa_attention
from ..ops.sfa.cache import SFAKeyCache
from ..ops.sfa.codes import scatter_codes, select, sparsify
from ..ops.sfa.decode import sfa_decode


class CachedKeys:
    """The keys of one attention layer held in an :class:`~sieve_attn.ops.sfa.cache.SFAKeyCache`: what
    :class:`sieve_attn.SFACache` hands the attention function in place of the dense keys [B, Hkv, Tk, D].

    ``cache`` already holds this call's Tq tokens: Tk = len(cache), and query i sits at cache position Tk - Tq + i.
    ``new`` is the dense keys [B, Hkv, Tq, D] of this call's tokens when the cache held none before it (a prompt,
    Tk == Tq), else None. Both hold the keys as mapped by the feature map of ``layer``, the SFA layer the cache was
    built for (:meth:`SFALayer.map_keys`). Any other attribute raises AttributeError: only
    :meth:`SFALayer.attend` reads these keys.
    """

    __slots__ = ("cache", "new", "layer")

    def __init__(self, cache: SFAKeyCache, layer: "SFALayer", new: Optional[torch.Tensor] = None):
        self.cache, self.layer, self.new = cache, layer, new

    def dense(self) -> torch.Tensor:
        """Keys k [B, Hkv, Tk, D] for the dense-key path: ``new`` when set, else the cached codes zero-filled
        (densified, a transient tensor). Either way sparsify(k, topk) is the sparse keys of the dense path, which
        is all SFA reads of k."""
        return self.new if self.new is not None else scatter_codes(*self.cache.keys(), self.cache.head_dim)

    def __getattr__(self, name: str):
        # Reached only for missing attributes: model code other than the sieve attention function touched the keys.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"keys held by a sieve_attn.SFACache have no attribute {name!r}: they can only be read "
                             "by the 'sieve_focus' attention function of a model composed with an SFAConfig")


def _by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, Hq, T, D] as [B, Hkv, Hq / Hkv, T, D]: query head h under KV head h // (Hq / Hkv), as GQA groups them."""
    return q.unflatten(1, (kv_heads, q.shape[1] // kv_heads))


def residual_energy(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Mean over the vectors of x [..., D] of ||x - kept||^2 / ||x||^2 (float32; a zero vector counts 0), with kept
    [..., D] x's sparse form (x on its kept coordinates, 0 elsewhere): the fraction of each vector's energy its
    top-k drops. Differentiable in x: through ``kept`` (straight-through on the kept coordinates, where the
    numerator's terms cancel) only the dropped coordinates and the denominator carry gradient."""
    x = x.float()
    dropped = x - kept.float()
    energy = x.pow(2).sum(-1)
    return (dropped.pow(2).sum(-1) / energy.clamp_min(torch.finfo(torch.float32).tiny)).mean()


class Moments:
    """Running second moments of one layer's q and k (after RoPE, before any feature map), in float32:
    ``keys`` [Hkv, D, D], the sum of k k^T over the keys of each KV head; ``queries`` [Hkv, D, D], the sum of q q^T
    over the queries of each KV head's query heads; ``key_count`` and ``query_count``, the vectors summed per KV
    head."""

    def __init__(self):
        self.keys = self.queries = 0  # tensors after the first add
        self.key_count = self.query_count = 0

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Adds q [B, Hq, Tq, D] and k [B, Hkv, Tk, D]."""
        keys = k.float()
        queries = _by_kv_head(q.float(), k.shape[1]).transpose(2, 3).flatten(2, 3)  # [B, Hkv, Tq * Hq / Hkv, D]
        self.keys = self.keys + torch.einsum("bhtd,bhte->hde", keys, keys)
        self.queries = self.queries + torch.einsum("bhtd,bhte->hde", queries, queries)
        self.key_count += keys.shape[0] * keys.shape[2]
        self.query_count += queries.shape[0] * queries.shape[2]


class SFALayer(nn.Module):
    """Computes one attention layer with Sparse Feature Attention.

    With ``config.feature_map`` the layer holds ``feature_map`` [Hkv, D, D], a parameter (the identity at first):
    q and k are mapped as q @ feature_map[g] and k @ feature_map[g] (g the KV head of the query head) before their
    top-k (:meth:`map_queries`, :meth:`map_keys`). Without it the layer has no parameters.

    With ``config.selection == "importance"`` it holds ``selection_weights`` [2, Hkv, D], a float32 buffer (all 1
    at first, :func:`sieve_attn.calibrate_feature_maps` sets it): [0, g] ranks the coordinates of the queries of KV
    head g, [1, g] those of its keys (:func:`~sieve_attn.ops.sfa.codes.sparsify`'s ``weights``). map_queries and
    map_keys then return the vectors already reduced to their top-k, which every later plain top-k keeps as they
    are, so each attention path, cache and kernel computes the weighted codes unchanged. (Its straight-through
    gradient differs only at a selected coordinate whose value is exactly 0, which a plain top-k may swap for
    another zero.)

    While ``matching`` is on and autograd is recording, each call also computes the layer's dense attention output
    (on the unmapped q and k) without gradient and records mean((O_sfa - O_dense)^2) over batch, heads, tokens and
    features in ``matching_terms``: the paper's output-matching regulariser (Eq. 8), averaged over heads.

    While ``sparsity`` is on and autograd is recording, each call on dense keys also records in ``sparsity_terms``
    the residual energy of its sparse q and k: for every vector x of q and k in the feature basis (before the
    top-k), ||x - x~||^2 / ||x||^2 with x~ its top-k (the coordinates its selection keeps), averaged over the vectors
    of q and over those of k, then the mean of the two (:func:`residual_energy`). Under the straight-through rule the
    LM loss never reaches a coordinate the top-k drops; this term does, and shrinks the energy the top-k throws away.

    While ``moments`` is a :class:`Moments` (:func:`sieve_attn.calibrate_feature_maps` sets one), each call on dense
    keys adds its unmapped q and k to it.
    """

    def __init__(self, config: SFAConfig, kv_heads: int, head_dim: int):
        super().__init__()
        self.config = config
        # The top-k in use: config.topk, except while fine-tuning warms it up from the head dim
        # (FinetuneSettings.topk_warmup) or a calibration records dense moments.
        self.topk = config.topk
        self.matching = False
        self.matching_terms: list[torch.Tensor] = []
        self.sparsity = False
        self.sparsity_terms: list[torch.Tensor] = []
        self.moments: Optional[Moments] = None
        # Stored in float32 whatever the model's dtype, as the Focus routers are: in bfloat16 the calibrated axes
        # would be orthogonal only to about 2e-3 and small optimizer steps would round away. map_* cast it at use.
        self.feature_map = nn.Parameter(torch.eye(head_dim).repeat(kv_heads, 1, 1), requires_grad=False) \
            if config.feature_map else None
        self.register_buffer("selection_weights", torch.ones(2, kv_heads, head_dim)
                             if config.selection == "importance" else None)

    def extra_repr(self) -> str:
        return f"topk={self.topk}, feature_map={self.feature_map is not None}, selection={self.config.selection}"

    def map_keys(self, k: torch.Tensor) -> torch.Tensor:
        """k [B, Hkv, T, D] in the layer's feature basis (k itself without a feature map); with importance
        selection, reduced to its top-k coordinates by the key weights."""
        return self._select_keys(self._keys_in_basis(k))

    def map_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, D] in the feature basis of each query head's KV head (q itself without a feature map);
        with importance selection, reduced to its top-k coordinates by the query weights of its KV head."""
        return self._select_queries(self._queries_in_basis(q))

    def _keys_in_basis(self, k: torch.Tensor) -> torch.Tensor:
        return k if self.feature_map is None else torch.matmul(k, self.feature_map.to(k.dtype))

    def _select_keys(self, k: torch.Tensor) -> torch.Tensor:
        if self.selection_weights is None:
            return k
        # The weights stay float32: the ranks are products, which in bfloat16 would tie far more often. Calibration
        # made them finite and >= 0, so they go unchecked (a check would wait on the device every call).
        return select(k, self.topk, self.selection_weights[1, :, None, :])

    def _queries_in_basis(self, q: torch.Tensor) -> torch.Tensor:
        if self.feature_map is None:
            return q
        grouped = _by_kv_head(q, self.feature_map.shape[0])  # [B, Hkv, G, T, D]: each KV head's map over G
        return torch.matmul(grouped, self.feature_map.to(q.dtype)[:, None]).flatten(1, 2)

    def _select_queries(self, q: torch.Tensor) -> torch.Tensor:
        if self.selection_weights is None:
            return q
        grouped = _by_kv_head(q, self.selection_weights.shape[1])
        return select(grouped, self.topk, self.selection_weights[0, :, None, None, :]).flatten(1, 2)

    def attend(self, q, k, v, *, attn_mask=None, scale=None, softcap=None, focus=None) -> torch.Tensor:
        """Attention output [B, Hq, Tq, D] with SFA scores; with ``focus`` (the layer's
        :class:`~sieve_attn.nn.focus_layer.FocusLayer`), over the Focus pattern: the sparse q and k go through
        Focus's own op, so its backends compute SFA scores exactly (pairs sharing no coordinate score 0).

        k is dense [B, Hkv, Tk, D] or :class:`CachedKeys`. Cached keys whose cache held tokens before this call are
        read by :func:`~sieve_attn.ops.sfa.decode.sfa_decode` (their codes only) when the call is plain causal SFA:
        no ``attn_mask`` (transformers passes none without padding, on a full-attention layer or on a sliding one
        still within its window), no ``softcap`` and no ``focus``. Otherwise :meth:`CachedKeys.dense` gives the
        dense-key path keys of the same sparse form, so the result is the same. With a feature map, q and k are
        mapped first (cached keys were mapped before the cache stored them: :class:`CachedKeys`)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if isinstance(k, CachedKeys):
            self._check_cached(k)
            q = self.map_queries(q)
            if k.new is None and attn_mask is None and softcap is None and focus is None:
                return sfa_decode(q, k.cache, scale=scale, backend=sfa_decode_backend(self.config.backend))[0]
            k, target = k.dense(), None  # already mapped: SFACacheLayer stores the mapped keys
        else:
            self._record_moments(q, k)
            target = self._dense_target(q, k, v, attn_mask, scale, softcap)
            q, k = self._queries_in_basis(q), self._keys_in_basis(k)
            sparse_q, sparse_k = self._select_queries(q), self._select_keys(k)
            self._record_residual_energy(q, k, sparse_q, sparse_k)
            q, k = sparse_q, sparse_k
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
        # The cache codes keys with its layers' top-k and feature maps: those of the model it was built for.
        if k.layer is not self:
            fail("past_key_values", "an SFACache built for this model (SFACache(model))",
                 "one built for the SFA layers of another model")
        if self.matching and torch.is_grad_enabled():
            fail("past_key_values", "no SFACache while the output-matching term is recorded (it needs dense keys)",
                 "an SFACache")

    def _record_residual_energy(self, q, k, selected_q, selected_k) -> None:
        """While ``sparsity`` is on and autograd records: q and k in the feature basis, and what the layer's
        selection made of them (themselves without selection weights, whose plain top-k the attention op takes:
        the same top-k here)."""
        if not (self.sparsity and torch.is_grad_enabled()):
            return
        if self.selection_weights is None:
            selected_q, selected_k = select(q, self.topk), select(k, self.topk)
        self.sparsity_terms.append((residual_energy(q, selected_q) + residual_energy(k, selected_k)) / 2)

    def _record_moments(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if self.moments is not None:
            with torch.no_grad():
                self.moments.add(q, k)

    def _dense_target(self, q, k, v, attn_mask, scale, softcap) -> Optional[torch.Tensor]:
        """The layer's dense causal attention output [B, Hq, Tq, D] (no gradient) while the matching term is
        recorded, else None. Without a mask and a softcap PyTorch's SDPA computes it: a regression target needs no
        graph, and on a GPU SDPA's fused kernels beat the blockwise reference, which writes every block's float32
        scores to memory. A mask (SDPA would need it as a Tq x Tk tensor) or a softcap (SDPA has none) takes the
        blockwise reference, in O(block x Tk) memory."""
        if not (self.matching and torch.is_grad_enabled()):
            return None
        with torch.no_grad():
            if attn_mask is None and softcap is None:
                return unmasked_sdpa(q, k, v, causal=True, scale=scale)
            return blockwise_attention(q, k, v, scale=scale, causal=True, softcap=softcap, attn_mask=attn_mask)[0]
