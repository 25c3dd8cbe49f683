"""Device probe (v11, session 27; not a library file): knobs of the SFA decode step that need no code change,
side by side. A plan is POOLED:UNIT:STAGES:PER_SM:MERGE_CHUNKS:MERGE_D:POOL_FROM:PREFETCH (decode._POOLED,
_UNIT_TILES, _NUM_STAGES, _programs_per_sm, split_k._MERGE_CHUNKS, _MERGE_D, decode._POOL_FROM_TILES,
_PREFETCH_TILES; calls A and B ran before the last existed, with 7 fields); "base" is the committed one. Each plan is gated like the tests (error against float64 at most twice the error of the reference run in
bfloat16, plus 1e-6, over 3 calls: the pool's split varies; FAIL prints no time), captured as a CUDA graph; then
all are timed (cold L2, sieve_attn.bench.timing, 50 reps) once per round in PROBE_ROUNDS (5) interleaved rounds
beside dense SDPA-cuDNN decode, median of the rounds reported. GQA 32/8, bf16, batch 1, D = 128, at each length
of PROBE_LENGTHS (cached tokens, default 131072).
Usage: python step_probe.py OUT PLANS. Writes OUT/step_probe_T{lengths}.json."""
import json
import os
import statistics
import sys

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops import split_k
from sieve_attn.ops.sfa import decode
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.reference import sfa_attention_reference

BASE = (f"{decode._POOLED}:{decode._UNIT_TILES}:{decode._NUM_STAGES}:{decode._programs_per_sm(128)}:"
        f"{split_k._MERGE_CHUNKS}:{split_k._MERGE_D}:{decode._POOL_FROM_TILES}:{decode._PREFETCH_TILES}")
out_dir, plans = sys.argv[1], list(dict.fromkeys(p if p != "base" else BASE for p in sys.argv[2].split(",")))
dev = torch.device("cuda")
HQ, HKV, D = 32, 8, 128
ROUNDS = int(os.environ.get("PROBE_ROUNDS", 5))
LENGTHS = [int(t) for t in os.environ.get("PROBE_LENGTHS", "131072").split(",")]
scale = D ** -0.5


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def apply(plan):
    pooled, unit, stages, per_sm, merge_chunks, merge_d, pool_from, prefetch = plan.split(":")
    decode._PREFETCH_TILES = int(prefetch)
    decode._POOLED, decode._UNIT_TILES, decode._NUM_STAGES = float(pooled), int(unit), int(stages)
    decode._programs_per_sm = lambda head_dim, p=int(per_sm): p
    split_k._MERGE_CHUNKS, split_k._MERGE_D = int(merge_chunks), int(merge_d)
    decode._POOL_FROM_TILES = int(pool_from)


rows = []
for T in LENGTHS:
    torch.manual_seed(0)
    q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    dense = graphed(lambda: sdpa(q, k, v, "cudnn", causal=False))
    for topk in (16, 8):
        cache = SFAKeyCache(1, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
        cache.append(k, v)
        exact = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True, scale=scale)[0]
        low_err = err(sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)[0], exact)
        timers = {"dense": dense}
        for plan in plans:
            apply(plan)
            row = dict(plan=plan, topk=topk, T=T)
            try:
                with skip_nan_checks():
                    run = lambda: decode.sfa_decode_triton(q, cache, scale=scale)[0]
                    errors = [err(run(), exact) for _ in range(3)]
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
            row = dict(plan=name, topk=topk, T=T, D=D, rounds=samples, ms=statistics.median(samples),
                       x_dense=statistics.median(times["dense"]) / statistics.median(samples))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cache, timers
    apply(BASE)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, base=BASE, rows=rows),
          open(os.path.join(out_dir, f"step_probe_T{'_'.join(map(str, LENGTHS))}.json"), "w"), indent=1)
