"""Shared helpers: load SmolLM2-135M via the library, capture post-RoPE q, k, v per layer (patched SFALayer.attend on
a model composed with SFAConfig(topk=D): the carrier only; attention itself is computed densely with SDPA here)."""
import torch, torch.nn.functional as F
import sieve_attn as sa
from sieve_attn.cli import _windows
from sieve_attn.models import load_model
from sieve_attn.nn import sfa_layer
from sieve_attn.integrations.transformers import sfa_layers

ATTEND = sfa_layer.SFALayer.attend
STATE = {"capture": None, "hook": None}


def patched_attend(self, q, k, v, *, attn_mask=None, scale=None, softcap=None, focus=None):
    assert attn_mask is None and softcap is None and focus is None
    if STATE["capture"] is not None and self.idx in STATE["capture"]:
        STATE["capture"][self.idx].append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
    if STATE["hook"] is not None:
        out = STATE["hook"](self.idx, q, k, v)
        if out is not None:
            return out
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def carrier_model():
    model, tok = load_model()
    sa.compose(model, sa.SFAConfig(topk=64))
    for i, layer in enumerate(sfa_layers(model)):
        layer.idx = i
    sfa_layer.SFALayer.attend = patched_attend
    return model, tok


def windows(tok, split, n, context=1024):
    return _windows(tok, None, split, context, n)


@torch.no_grad()
def capture(model, wins, layers):
    STATE["capture"] = {i: [] for i in layers}
    for w in wins:
        model(w[None], use_cache=False)
    out = {i: tuple(torch.cat(t) for t in zip(*STATE["capture"][i])) for i in layers}  # q [N,Hq,T,D], k, v [N,Hkv,T,D]
    STATE["capture"] = None
    return out
