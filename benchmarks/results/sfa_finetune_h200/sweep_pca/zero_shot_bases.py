# Zero-shot PPL of SmolLM2-135M with SFA (top-k from argv, default 16) under fixed orthogonal bases per layer and KV
# head, applied after RoPE to q and k alike (CPU, ~10 min): the identity, the principal axes of keys, of queries,
# and of mixes of the two. The experiment that chose calibrate_feature_maps' rule (session 14; see NOTES.md).
# Run from the repository root: python benchmarks/results/sfa_finetune_h200/sweep_pca/zero_shot_bases.py 16
import sys, time, torch
import sieve_attn as sa
from sieve_attn.models import load_model
from sieve_attn.data.text import stdlib_split, token_windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn.nn import sfa_layer

torch.manual_seed(0)
model, tok = load_model()
train, held = stdlib_split()
calib = token_windows(tok, train[::40], 512, 8)
evalw = token_windows(tok, held, 1024, 6)
topk = int(sys.argv[1]) if len(sys.argv) > 1 else 16
model = sa.compose(model, sa.SFAConfig(topk=topk, backend="reference"))
layers = [m for m in model.modules() if isinstance(m, sfa_layer.SFALayer)]
orig = sfa_layer.SFALayer.attend
mode = {"collect": False, "R": None}
stats = {}

def attend(self, q, k, v, **kw):
    i = self.index
    if mode["collect"]:
        hq, hk = q.shape[1], k.shape[1]
        qf = q.float().unflatten(1, (hk, hq // hk))  # B Hk G T D
        Ck = torch.einsum("bhtd,bhte->hde", k.float(), k.float()) / k.shape[2]
        Cq = torch.einsum("bhgtd,bhgte->hde", qf, qf) / q.shape[2] / (hq // hk)
        s = stats.setdefault(i, [0, 0])
        s[0] = s[0] + Ck; s[1] = s[1] + Cq
    if mode["R"] is not None:
        R = mode["R"][i].to(q.dtype)  # Hk D D
        hq, hk = q.shape[1], k.shape[1]
        q = torch.einsum("bhgtd,hde->bhgte", q.unflatten(1, (hk, hq // hk)), R).flatten(1, 2)
        k = torch.einsum("bhtd,hde->bhte", k, R)
    return orig(self, q, k, v, **kw)

for i, l in enumerate(layers):
    l.index = i
sfa_layer.SFALayer.attend = attend
t = time.time()
mode["collect"] = True
for l in layers: l.topk = 64
with torch.no_grad():
    for w in calib.split(2):
        model(w, use_cache=False)
mode["collect"] = False
print("collect", time.time() - t, flush=True)
dense = perplexity(model, evalw, progress=False)["ppl"]
for l in layers: l.topk = topk
print("dense", dense, "identity", perplexity(model, evalw, progress=False)["ppl"], flush=True)

def eig_basis(C):
    evals, evecs = torch.linalg.eigh(C)
    return evecs.flip(-1)


def nrm(C): return C / C.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
variants = {
 "pcaK": lambda s: s[0],
 "pcaQ": lambda s: s[1],
 "qk.3": lambda s: 0.3 * nrm(s[0]) + 0.7 * nrm(s[1]),
 "qk.5": lambda s: nrm(s[0]) + nrm(s[1]),
 "qk.7": lambda s: 0.7 * nrm(s[0]) + 0.3 * nrm(s[1]),
 "prod": lambda s: nrm(s[0]) @ nrm(s[1]) + nrm(s[1]) @ nrm(s[0]),
 "raw": lambda s: s[0] + s[1],
}
for name, pick in variants.items():
    mode["R"] = {i: eig_basis(pick(stats[i])) for i in stats}
    print(name, perplexity(model, evalw, progress=False)["ppl"], flush=True)
