# Held-out perplexity of SmolLM2-135M converted to SFA, over the dense fine-tune's, against k: session 35's runs on
# one H100 and the k = 8 run of commit 00276dc on an H200 (../distill_importance/call_2), one recipe. Writes
# topk_sweep.png and topk_sweep.json here.
#   python benchmarks/results/sfa_finetune_h200/topk_sweep/plot.py
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
result = lambda path: json.load(open(here / path))
runs = [  # (k, SFA run, the dense fine-tune of the same call: its teacher and baseline)
    (8, "../distill_importance/call_2/k8-pca-imp-l1-warm100/result.json",
     "../distill_importance/call_2/dense/result.json"),
    (16, "../local_fit/call_c/pca/result.json", "../local_fit/call_b/dense/result.json"),
    (20, "call_f/k20/result.json", "call_e/dense/result.json"),
    (24, "call_e/k24/result.json", "call_e/dense/result.json"),
    (32, "call_e/k32/result.json", "call_e/dense/result.json"),
]
rows = []
for k, sfa, dense in runs:
    s, d = result(sfa), result(dense)
    rows.append(dict(topk=k, head_dim=64, sfa_ppl=s["ppl_after"], dense_ppl=d["ppl_after"],
                     ratio=s["ppl_after"] / d["ppl_after"], best_step=s["best_step"], sfa_result=sfa,
                     card=s["environment"]["device"]))
json.dump(rows, open(here / "topk_sweep.json", "w"), indent=1)
fig, ax = plt.subplots(figsize=(5.5, 3.6))
ax.plot([r["topk"] for r in rows], [r["ratio"] for r in rows], "o-", label="SFA, distilled (400 steps)")
ax.axhline(1.05, color="tab:red", ls="--", lw=1, label="issue 4's target (1.05x)")
ax.axhline(1.0, color="gray", lw=0.8)
for r in rows:
    ax.annotate(f'{r["ratio"]:.3f}x', (r["topk"], r["ratio"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
ax.set_xlabel("k (coordinates kept of q and k, of 64)")
ax.set_ylabel("held-out PPL / dense fine-tune's")
ax.set_title("SmolLM2-135M converted to SFA", fontsize=10)
ax.set_xticks([r["topk"] for r in rows])
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "topk_sweep.png", dpi=130)
for r in rows:
    print(r["topk"], f'{r["sfa_ppl"]:.3f} / {r["dense_ppl"]:.3f} = {r["ratio"]:.3f}', r["card"])
