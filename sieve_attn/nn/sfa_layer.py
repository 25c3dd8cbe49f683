"""SFA attached to one attention layer: sparse q and k, and the output-matching term of dense-to-SFA conversion."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import SFAConfig
from ..ops.blockwise import blockwise_attention
from ..ops.sfa.attention import sfa_attention
from ..ops.sfa.codes import sparsify


class SFALayer(nn.Module):
    """Computes one attention layer with Sparse Feature Attention (no parameters of its own).

    While ``matching`` is on and autograd is recording, each call also computes the layer's dense attention output
    without gradient and records mean((O_sfa - O_dense)^2) over batch, heads, tokens and features in
    ``matching_terms``: the paper's output-matching regulariser (Eq. 8), averaged over heads.
    """

    def __init__(self, config: SFAConfig):
        super().__init__()
        self.config = config
        self.matching = False
        self.matching_terms: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        return f"topk={self.config.topk}"

    def attend(self, q, k, v, *, attn_mask=None, scale=None, softcap=None, focus=None) -> torch.Tensor:
        """Attention output [B, Hq, Tq, D] with SFA scores; with ``focus`` (the layer's
        :class:`~sieve_attn.nn.focus_layer.FocusLayer`), over the Focus pattern: the sparse q and k go through
        Focus's own op, so its backends compute SFA scores exactly (pairs sharing no coordinate score 0)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        target = self._dense_target(q, k, v, attn_mask, scale, softcap)
        topk = self.config.topk
        if focus is not None:
            out = focus.attend(sparsify(q, topk), sparsify(k, topk), v, attn_mask=attn_mask, scale=scale,
                               softcap=softcap)
        else:
            out = sfa_attention(q, k, v, topk=topk, scale=scale, softcap=softcap, attn_mask=attn_mask,
                                backend=self.config.backend)
        if target is not None:
            self.matching_terms.append((out.float() - target.float()).pow(2).mean())
        return out

    def _dense_target(self, q, k, v, attn_mask, scale, softcap) -> Optional[torch.Tensor]:
        if not (self.matching and torch.is_grad_enabled()):
            return None
        with torch.no_grad():
            return blockwise_attention(q, k, v, scale=scale, causal=True, softcap=softcap, attn_mask=attn_mask)[0]
