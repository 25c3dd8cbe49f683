# CPU probe (session 35): does a trained, possibly overcomplete feature map lower SFA's zero-shot loss? Per layer,
# maps are trained to match each head's dense attention output (layer-local, inputs from the dense model), then the
# held-out PPL is measured with every layer's map in place. CPU, float32. Variants: pca (the library's calibration,
# untrained), train (one map for q and k), train-sep (a map each), train-xN (N * D coordinates). The run of NOTES.md:
#   python benchmarks/results/sfa_finetune_h200/local_fit/local_maps_probe.py OUT 16 pca,train,train-sep,train-x2 8 8 100
import json, math, os, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from sieve_attn.cli import _windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn.models import load_model

out = Path(sys.argv[1]); topk = int(sys.argv[2]); variants = sys.argv[3].split(",")
n_calib, n_held, steps = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(2); torch.manual_seed(0)

state = dict(mode="dense", captured={}, maps={})


def select(x, weights):
    """x [..., E] kept on its top-k of |x| * weights, zero elsewhere (straight-through)."""
    rank = x.detach().abs() * weights
    idx = rank.topk(topk, dim=-1).indices
    mask = torch.zeros_like(x).scatter_(-1, idx, 1.0)
    return x * mask


def mapped_attention(q, k, v, maps, scale):
    """q [B, Hq, T, D], k, v [B, Hkv, T, D]; maps: (Mq [Hkv, E, D], Mk [Hkv, E, D], wq [Hkv, E], wk [Hkv, E])."""
    mq, mk, wq, wk = maps
    g = q.shape[1] // k.shape[1]
    qm = torch.einsum("bhgtd,hed->bhgte", q.unflatten(1, (k.shape[1], g)), mq)
    km = torch.einsum("bhtd,hed->bhte", k, mk)
    qs = select(qm, wq[None, :, None, None]).flatten(1, 2)
    ks = select(km, wk[None, :, None])
    return F.scaled_dot_product_attention(qs, ks, v, is_causal=True, scale=scale, enable_gqa=True)


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    layer = module.layer_idx
    if state["mode"] == "capture":
        state["captured"].setdefault(layer, []).append((query.detach(), key.detach(), value.detach()))
    if state["mode"] in ("dense", "capture"):
        o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        o = mapped_attention(query, key, value, state["maps"][layer], scaling)
    return o.transpose(1, 2).contiguous(), None


AttentionInterface.register("probe", probe_attention)
model, tok = load_model()
model.set_attn_implementation("probe")
held, calib = _windows(tok, None, 1, 1024, n_held), _windows(tok, None, 0, 1024, n_calib)
rows = []
state["mode"] = "dense"
rows.append(dict(variant="dense", ppl=perplexity(model, held, progress=False)["ppl"])); print(rows[-1], flush=True)
state["mode"] = "capture"
with torch.no_grad():
    for w in calib:
        model(w[None], use_cache=False)
captured = {l: [torch.cat(t) for t in zip(*v)] for l, v in state["captured"].items()}
state["captured"] = {}


def pca_init(q, k):
    """The library's calibration: eigenvectors of C_k/tr + C_q/tr per KV head; importance weights."""
    hkv, d = k.shape[1], k.shape[-1]
    kk = k.transpose(0, 1).reshape(hkv, -1, d)
    qq = q.unflatten(1, (hkv, -1)).transpose(0, 1).reshape(hkv, -1, d)
    ck = torch.einsum("htd,hte->hde", kk, kk) / kk.shape[1]
    cq = torch.einsum("htd,hte->hde", qq, qq) / qq.shape[1]
    c = ck / ck.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None] + cq / cq.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None]
    evals, evecs = torch.linalg.eigh(c)
    m = evecs.flip(-1).transpose(1, 2)  # rows = axes [Hkv, D, D]
    return m, ck, cq


def weights_for(mq, mk, ck, cq):
    wq = torch.einsum("hed,hdf,hef->he", mk, ck, mk).clamp_min(0).sqrt()  # keys' rms along each axis
    wk = torch.einsum("hed,hdf,hef->he", mq, cq, mq).clamp_min(0).sqrt()
    return wq, wk


def train_layer(q, k, v, scale, variant):
    m, ck, cq = pca_init(q, k)
    hkv, d = m.shape[0], m.shape[-1]
    expand = int(variant.split("x")[1]) if "x" in variant else 1
    if expand > 1:
        extra = [torch.linalg.qr(torch.randn(hkv, d, d))[0] @ m for _ in range(expand - 1)]
        m = torch.cat([m] + extra, 1) / math.sqrt(expand)
    mq = m.clone().requires_grad_("train" in variant)
    mk = mq if "sep" not in variant else m.clone().requires_grad_(True)
    wq, wk = weights_for(mq.detach(), mk.detach(), ck, cq)
    if "mag" in variant:
        wq, wk = torch.ones_like(wq), torch.ones_like(wk)
    with torch.no_grad():
        target = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        norm = target.pow(2).mean()
    first = last = None
    if "train" in variant:
        params = [mq] if mk is mq else [mq, mk]
        opt = torch.optim.Adam(params, lr=float(os.environ.get("LR", "2e-3")))
        n = q.shape[0]
        for step in range(steps):
            b = torch.randperm(n)[:2]
            o = mapped_attention(q[b], k[b], v[b], (mq, mk, wq, wk), scale)
            loss = (o - target[b]).pow(2).mean() / norm
            opt.zero_grad(); loss.backward(); opt.step()
            if step % 20 == 0 or step == steps - 1:
                with torch.no_grad():
                    wq, wk = weights_for(mq.detach(), mk.detach(), ck, cq) if "mag" not in variant else (wq, wk)
            first = loss.item() if first is None else first
            last = loss.item()
    with torch.no_grad():
        o = mapped_attention(q, k, v, (mq, mk, wq, wk), scale)
        final = ((o - target).pow(2).mean() / norm).item()
    return (mq.detach(), mk.detach(), wq, wk), dict(first=first, last=last, final=final)


scale = 1 / math.sqrt(captured[0][0].shape[-1])
for variant in variants:
    started = time.time()
    errs = []
    for layer in sorted(captured):
        q, k, v = captured[layer]
        state["maps"][layer], err = train_layer(q, k, v, scale, variant)
        errs.append(err["final"])
    state["mode"] = "mapped"
    ppl = perplexity(model, held, progress=False)["ppl"]
    rows.append(dict(variant=variant, topk=topk, ppl=ppl, local_error_mean=sum(errs) / len(errs),
                     local_errors=[round(e, 4) for e in errs], seconds=round(time.time() - started)))
    print({k: v for k, v in rows[-1].items() if k != "local_errors"}, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    json.dump(rows, open(out / f"local_maps_k{topk}.json", "w"), indent=1)
