"""Device probe (v16): the decode kernel's plan re-swept after v15's scan change (256-key scan steps, 3 stages),
which cut the per-program scan time and so may move the best split (programs per SM), the attention tiles' keys
and their pipeline stages.

A different split changes the order of the chunk sums, so a plan is checked against the float32 reference (within
twice the committed plan's error, and 1e-2), not bit for bit. CUDA-graph replays with a cold L2, against dense
SDPA decode, as the bench times them. 128K cached tokens, GQA 32/8, B=1, K=8, window 128; D the second argument
(default 128; call M ran 128, call N 64, where the kernel holds fewer registers, so more programs may fit an SM).
Writes OUT/decode_plan_probe_d{D}.json (OUT: the first argument). A record of calls M and N: it sets
decode._BLOCK_N, which decode._block_n replaced after them (bf9db09), so it no longer runs on the current code;
v17/probe_decode_plan2.py probes the plan after that change."""
import json
import os
import sys

import torch

from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus import decode
from sieve_attn.ops.focus.reference import focus_attention_reference, group_bits

dev = torch.device("cuda")
torch.manual_seed(0)
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
B, HQ, HKV, T, K, W = 1, 32, 8, 128 * 1024, 8, 128
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
backend = first_working_sdpa(q, k, v, causal=False)
dense_ms = measure(graphed(lambda: sdpa(q, k, v, backend, causal=False)), dev, warmup=3, reps=50, budget_s=1.0).ms
print(f"dense sdpa decode ({backend}) {dense_ms:.4f} ms", flush=True)
rows = [dict(name="dense", backend=backend, ms=dense_ms)]
FIELDS = ("_BLOCK_N", "_NUM_STAGES", "_PROGRAMS_PER_SM", "_SCAN_N", "_SCAN_STAGES")
base = tuple(getattr(decode, f) for f in FIELDS)
if D == 128:  # call M, before _SCAN_N became 512
    plans = [base] + [(64, 2, p, 256, 3) for p in (3, 4, 8, 9, 12)] + [
        (64, 3, 6, 256, 3), (32, 2, 6, 256, 3), (32, 2, 12, 256, 3), (128, 2, 6, 256, 3), (64, 2, 6, 512, 3),
        (64, 2, 6, 128, 3)] + [base]
else:
    plans = [base] + [(64, 2, p, 512, 3) for p in (3, 4, 8, 9, 12, 16)] + [
        (64, 3, 6, 512, 3), (64, 3, 9, 512, 3), (128, 2, 6, 512, 3), (128, 2, 9, 512, 3), (64, 2, 6, 256, 3)] + [base]
cases = [("top1", balanced_groups(T, K, 1)), ("top2_combinations", balanced_groups(T, K, 2)),
         ("top2_adjacent", balanced_groups(T, K, 2, spread="adjacent"))]
for name, ids in cases:
    ids = ids.to(dev)
    bits = group_bits(ids)
    ref, _ = focus_attention_reference(q.float(), k.float(), v.float(), ids, window=W, causal=True, scale=D ** -0.5)
    call = lambda: decode.focus_decode(q, k, v, bits, window=W, scale=D ** -0.5)
    base_err = (call()[0].float() - ref).abs().max().item()
    assert base_err < 1e-2, f"{name}: the committed plan is off the reference by {base_err}"
    for plan in plans:
        for field, value in zip(FIELDS, plan):
            setattr(decode, field, value)
        row = dict(name=name, **{f.strip("_").lower(): x for f, x in zip(FIELDS, plan)})
        try:
            err = (call()[0].float() - ref).abs().max().item()
            ok = err <= max(2 * base_err, 1e-6) and err < 1e-2
            ms = measure(graphed(call), dev, warmup=3, reps=50, budget_s=1.0).ms if ok else None
            row.update(reference_err=err, ok=ok, ms=ms, x_dense=dense_ms / ms if ms else None)
        except Exception as error:  # a plan Triton cannot build (shared memory, registers)
            row.update(error=repr(error)[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
    for field, value in zip(FIELDS, base):
        setattr(decode, field, value)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               rows=rows), open(os.path.join(sys.argv[1], f"decode_plan_probe_d{D}.json"), "w"), indent=1)
