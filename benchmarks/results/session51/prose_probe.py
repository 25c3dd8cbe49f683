"""Zero-shot SFA k=16 (PCA maps, importance) on code vs prose: does the gap depend on the text's kind?"""
import sys, time, glob, torch
import sieve_attn as sa
from sieve_attn.cli import _windows
from sieve_attn.data.text import token_windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn.models import load_model
torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
model, tok = load_model(device="cpu")
vim = sorted(glob.glob("/usr/share/vim/vim90/doc/*.txt"))
prose_cal = token_windows(tok, [p for i, p in enumerate(vim) if i % 2 == 0], 1024, 16)
prose_held = token_windows(tok, [p for i, p in enumerate(vim) if i % 2 == 1], 1024, N)
code_cal = _windows(tok, None, 0, 1024, 16)
code_held = _windows(tok, None, 1, 1024, N)
for name, cal, held in (("prose", prose_cal, prose_held), ("code", code_cal, code_held)):
    model, _ = load_model(device="cpu")
    dense = perplexity(model, held, desc="dense")["ppl"]
    sa.compose(model, sa.SFAConfig(topk=16, feature_map=True, selection="importance"))
    sa.calibrate_feature_maps(model, cal)
    sfa = perplexity(model, held, desc="sfa")["ppl"]
    print(f"{name}: dense {dense:.3f} sfa16 {sfa:.3f} ratio {sfa/dense:.3f} nats {torch.tensor(sfa/dense).log():.3f}", flush=True)
