# Zero-shot (session 23): SFA k=16 (PCA map + importance, calibrated) on one layer at a time, the rest dense: which layers
# carry the loss? SmolLM2-135M, CPU, 6 held-out windows of 1024; calibration 16 training windows. Writes
# /tmp/layer_probe_k{topk}.json (copied here as layer_probe_k16.json). Run from the repository root.
import sys, time, torch, json
import sieve_attn as sa
from sieve_attn.models import load_model
from sieve_attn.cli import _windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn.integrations.transformers import sfa_layers
torch.set_num_threads(2)
topk = int(sys.argv[1]) if len(sys.argv) > 1 else 16
model, tok = load_model()
held = _windows(tok, None, 1, 1024, 6)
calib = _windows(tok, None, 0, 1024, 16)
sa.compose(model, sa.SFAConfig(topk=topk, feature_map=True, selection="importance"))
sa.calibrate_feature_maps(model, calib, progress=False)
layers = list(sfa_layers(model))
D = 64
for l in layers: l.topk = D
dense = perplexity(model, held, progress=False)["ppl"]
for l in layers: l.topk = topk
allsfa = perplexity(model, held, progress=False)["ppl"]
print("dense", dense, "all", allsfa, flush=True)
rows = []
for i, layer in enumerate(layers):
    for l in layers: l.topk = D
    layer.topk = topk
    ppl = perplexity(model, held, progress=False)["ppl"]
    rows.append((i, ppl)); print(i, round(ppl, 4), f"{(ppl / dense - 1) * 100:+.2f}%", flush=True)
json.dump(dict(dense=dense, all=allsfa, rows=rows), open(f"/tmp/layer_probe_k{topk}.json", "w"))
