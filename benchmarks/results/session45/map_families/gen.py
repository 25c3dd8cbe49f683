"""Generalisation check: learnB-k16 on one layer learned from 24 training windows (8 per step) instead of 8;
held-out error on the same 4 held-out windows as the study. Usage: gen.py LAYER STEPS"""
import sys, time, json, torch
sys.path.insert(0, "/tmp/overcomplete")
torch.set_num_threads(2)
from common import *
import study
layer, steps = int(sys.argv[1]), int(sys.argv[2])
model, tok = carrier_model()
t = time.time()
q, k, v = capture(model, windows(tok, 0, 24), [layer])[layer]
del model
print("captured", time.time() - t, flush=True)
held = torch.load("/tmp/overcomplete/cap.pt")["held"][layer]
out = {}
for name in ("pca-k16", "learnB-k16"):
    torch.manual_seed(0)
    m, alpha = study.build(name, q, k, v, steps)
    out[name] = {"held": study.rel_err(m, *held), "train": study.rel_err(m, q[:2], k[:2], v[:2])}
    print(layer, name, out[name], flush=True)
json.dump(out, open(f"/tmp/overcomplete/gen_L{layer}.json", "w"), indent=1)
