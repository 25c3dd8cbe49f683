"""Zero-shot held-out perplexity of SmolLM2-135M with each layer's attention replaced by SFA under fitted maps.
Stage 1 (fit): capture q, k, v of all 30 layers on 8 training windows of 1024, fit PCA maps (k=16, 20) and learn the
square balanced map (learnB, B = A^-T) per layer; saves fitted.pt (resumable per layer).
Stage 2 (eval): perplexity on the first EVAL held-out windows of 1024 for dense and each fitted method.
Usage: ppl.py fit STEPS | ppl.py eval EVAL"""
import sys, time, json, math, torch
sys.path.insert(0, "/tmp/overcomplete")
torch.set_num_threads(2)
from common import *
from maps import *
import study
study.ROWS = 64
from sieve_attn.eval.perplexity import perplexity

FIT = "/tmp/overcomplete/fitted.pt"
NAMES = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[1] == "fit" else ("pca-k16", "pca-k20", "learnB-k16")


def fit(steps):
    import os
    fitted = torch.load(FIT) if os.path.exists(FIT) else {}
    model, tok = carrier_model()
    train = windows(tok, 0, 8)
    t = time.time()
    data = capture(model, train, list(range(30)))
    print("captured", time.time() - t, flush=True)
    for layer in range(30):
        q, k, v = data[layer]
        for name in NAMES:
            if (name, layer) in fitted:
                continue
            t = time.time()
            torch.manual_seed(layer)
            m, alpha = study.build(name, q, k, v, steps)
            fitted[(name, layer)] = {"A": m.A, "B": m.B, "wq": m.wq, "wk": m.wk, "k": m.k}
            torch.save(fitted, FIT)
            print(f"layer {layer} {name} {time.time() - t:.1f} s", flush=True)


def evaluate(n_eval, names):
    fitted = torch.load(FIT)
    model, tok = carrier_model()
    held = windows(tok, 1, n_eval)
    rows = {}
    for name in ["dense"] + names:
        if name == "dense":
            STATE["hook"] = None
        else:
            base, kk = name.rsplit("@", 1) if "@" in name else (name, None)
            methods = {}
            for layer in range(30):
                f = fitted[(base, layer)]
                m = Method(int(kk) if kk else f["k"])
                m.A, m.B, m.wq, m.wk = f["A"], f["B"], f["wq"], f["wk"]
                methods[layer] = m

            def hook(idx, q, k, v, methods=methods):
                qs, ks, bias = methods[idx].transform(q, k)
                return attn(qs, ks, v, bias).flatten(1, 2)
            STATE["hook"] = hook
        t = time.time()
        rows[name] = perplexity(model, held, progress=False)["ppl"]
        print(f"{name}: ppl {rows[name]:.3f} ({time.time() - t:.0f} s)", flush=True)
    json.dump({"eval_windows": n_eval, "context": 1024, "ppl": rows}, open("/tmp/overcomplete/ppl.json", "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "fit":
        fit(int(sys.argv[2]))
    else:
        evaluate(int(sys.argv[2]), sys.argv[3].split(","))
