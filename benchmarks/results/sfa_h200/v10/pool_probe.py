"""Device probe (v10, session 26; not a library file): the SFA decode kernel whose programs take over a pool of
keys from each other (`_sfa_decode_chunk`: chunks cover 1 - POOLED of the tiles, the rest goes in units of UNIT
tiles to whichever program of the row block asks first), against POOLED = 0 (the chunks cover every key: the
kernel before this change, plus one atomic per program). Plans POOLED:UNIT:STAGES:PROGRAMS_PER_SM, each gated like
the tests (error against float64 at most twice the error of the reference run in bfloat16, plus 1e-6; FAIL prints
no time), captured as a CUDA graph; then all timed hot (cold L2, sieve_attn.bench.timing, 50 reps) once per round in
PROBE_ROUNDS (5) interleaved rounds beside dense SDPA-cuDNN decode; the median of the rounds is reported.
128K cached tokens, GQA 32/8, bf16, batch 1, D = PROBE_DIM (128).
Usage: python pool_probe.py OUT PLANS. Writes OUT/pool_probe_D{D}.json."""
import json
import os
import statistics
import sys

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.sfa import decode
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.reference import sfa_attention_reference

out_dir, plans = sys.argv[1], list(dict.fromkeys(sys.argv[2].split(",")))
dev = torch.device("cuda")
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, int(os.environ.get("PROBE_DIM", 128))
ROUNDS = int(os.environ.get("PROBE_ROUNDS", 5))
q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
scale = D ** -0.5


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


rows = []
dense = graphed(lambda: sdpa(q, k, v, "cudnn", causal=False))
for topk in (16, 8):
    cache = SFAKeyCache(1, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
    cache.append(k, v)
    exact = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True, scale=scale)[0]
    low_err = err(sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)[0], exact)
    timers = {"dense": dense}
    for plan in plans:
        pooled, unit, stages, per_sm = plan.split(":")
        decode._POOLED, decode._UNIT_TILES, decode._NUM_STAGES = float(pooled), int(unit), int(stages)
        decode._programs_per_sm = lambda head_dim, p=int(per_sm): p
        row = dict(plan=plan, topk=topk)
        try:
            with skip_nan_checks():
                run = lambda: decode.sfa_decode_triton(q, cache, scale=scale)[0]
                errors = [err(run(), exact) for _ in range(3)]  # the split varies from call to call
                row.update(err_ratio=max(errors) / low_err, ok=max(errors) <= 2 * low_err + 1e-6)
                if row["ok"]:
                    timers[plan] = graphed(run)  # captured with this plan's knobs
        except Exception as error:
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(("" if row.get("ok") else "FAIL ") + json.dumps(row), flush=True)
    times = {name: [] for name in timers}
    for _ in range(ROUNDS):
        for name, replay in timers.items():
            times[name].append(measure(replay, dev, warmup=20, reps=50, budget_s=1.0).ms)
    for name, samples in times.items():
        row = dict(plan=name, topk=topk, D=D, rounds=samples, ms=statistics.median(samples),
                   x_dense=statistics.median(times["dense"]) / statistics.median(samples))
        rows.append(row)
        print(json.dumps(row), flush=True)
    del cache, timers
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
          open(os.path.join(out_dir, f"pool_probe_D{D}.json"), "w"), indent=1)
