# Zero-shot (session 32): how much of SFA's zero-shot loss is the queries' top-k and how much the keys'? SmolLM2-135M,
# CPU, 32 held-out windows of 1024 (the fine-tunes' held-out set), calibration on the first 16 training windows, the
# calibrated PCA maps and importance selection. "both" is the library's SFA; "keys" keeps q dense (in the map's
# basis) and sparsifies k only, "queries" the reverse: both by patching the layer's selection and attention call in
# this process (a probe, not a library mode). Writes OUT/one_side.json. Run from the repository root:
#   python benchmarks/results/sfa_zero_shot_cpu/one_side/one_side_probe.py OUT 16,8
import json, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

import sieve_attn as sa
from sieve_attn.cli import _windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn._provenance import environment
from sieve_attn.models import load_model
from sieve_attn.nn import sfa_layer
from sieve_attn.ops.sfa.codes import sparsify

out, topks = Path(sys.argv[1]), [int(k) for k in sys.argv[2].split(",")]
torch.set_num_threads(2)
library = sfa_layer.sfa_attention, sfa_layer.SFALayer._select_queries, sfa_layer.SFALayer._select_keys


def one_side(side):
    """The layer's attention call with only `side` ("keys" or "queries") reduced to its top-k."""
    def attend(q, k, v, *, topk, scale=None, softcap=None, attn_mask=None, backend="auto"):
        assert softcap is None and attn_mask is None  # SmolLM2 without padding: plain causal
        q, k = (q, sparsify(k, topk)) if side == "keys" else (sparsify(q, topk), k)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return attend


def set_side(side):
    sfa_layer.sfa_attention, sfa_layer.SFALayer._select_queries, sfa_layer.SFALayer._select_keys = library
    if side == "keys":
        sfa_layer.sfa_attention, sfa_layer.SFALayer._select_queries = one_side(side), lambda self, q: q
    elif side == "queries":
        sfa_layer.sfa_attention, sfa_layer.SFALayer._select_keys = one_side(side), lambda self, k: k


model, tok = load_model()
held, calib = _windows(tok, None, 1, 1024, 32), _windows(tok, None, 0, 1024, 16)
rows = [dict(topk=None, side="dense", ppl=perplexity(model, held, progress=False)["ppl"])]
print(rows[-1], flush=True)
for topk in topks:
    model, _ = load_model()
    sa.compose(model, sa.SFAConfig(topk=topk, feature_map=True, selection="importance"))
    sa.calibrate_feature_maps(model, calib, progress=False)
    for side in ("both", "keys", "queries"):
        set_side(side)
        started = time.time()
        rows.append(dict(topk=topk, side=side, ppl=perplexity(model, held, progress=False)["ppl"],
                         seconds=round(time.time() - started)))
        print(rows[-1], flush=True)
    set_side("both")
out.mkdir(parents=True, exist_ok=True)
json.dump(dict(model="SmolLM2-135M", held_out_windows=len(held), calibration_windows=len(calib), rows=rows,
               environment=environment()), open(out / "one_side.json", "w"), indent=1)
