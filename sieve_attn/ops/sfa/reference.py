"""Plain-PyTorch reference of SFA (Sparse Feature Attention, arXiv 2603.22300).

Each query and key keeps its ``topk`` coordinates of largest |x| (:mod:`.codes`); V stays dense. The score of a
pair is ``scale * q_sparse . k_sparse``, a sum over the coordinates the two supports share, so a pair with no
shared coordinate scores exactly 0 and still receives softmax mass (the paper's claimed identity with
softmax(Q~K~^T / sqrt(d)) V). Masking, softmax and P.V are ordinary attention, computed
by :func:`sieve_attn.ops.blockwise.blockwise_attention` on the zero-filled q and k, so no Tq x Tk tensor is built
and positions follow that module's conventions (queries aligned to the end of the keys).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..blockwise import blockwise_attention
from .codes import sparsify


def sfa_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topk: int,
    causal: bool,
    scale: float,
    softcap: Optional[float] = None,
    attn_mask: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SFA attention. q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D], Hq % Hkv == 0; arguments already checked.

    q is sparsified per query head and k per KV head: blockwise_attention shares each KV head with its group of
    query heads without copying it, so k is sparsified once per KV head, as in GQA with the paper's per-head top-k.
    Gradients reach q and k only at their selected coordinates (straight-through rule of :func:`.codes.sparsify`).

    Returns out [B, Hq, Tq, D] (q's dtype; written into ``out`` when given) and lse [B, Hq, Tq].
    """
    return blockwise_attention(sparsify(q, topk), sparsify(k, topk), v, scale=scale, causal=causal, softcap=softcap,
                               attn_mask=attn_mask, out=out)
