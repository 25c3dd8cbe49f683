"""Device probe (v10, session 26; not a library file): does a decode step run slower right after the GPU sat idle
(as it does while Triton compiles a new kernel, which in `sieve bench` happens between the dense baseline's timing
and the sparse one's)? Each step (dense SDPA-cuDNN decode, SFA decode k=16 and k=8, Focus decode K=8 top-2; 128K
cached tokens, GQA 32/8, D=128, bf16, CUDA-graph replays with a cold L2 as sieve_attn.bench.timing) is timed after
2 s of sleep with W ms of its own replays first (W = 0: the bench's 3 warm-up calls), in rounds that interleave the
steps, and once more hot (no sleep). Usage: python warm_probe.py OUT. Writes OUT/warm_probe.json."""
import json
import os
import statistics
import sys
import time

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import sdpa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus.decode import focus_decode
from sieve_attn.ops.focus.reference import group_bits
from sieve_attn.ops.sfa import decode as head
from sieve_attn.ops.sfa.cache import SFAKeyCache

out_dir = sys.argv[1]
dev = torch.device("cuda")
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, 128
q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
scale = D ** -0.5
caches = {}
for topk in (16, 8):
    caches[topk] = SFAKeyCache(1, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
    caches[topk].append(k, v)
bits = group_bits(balanced_groups(T, 8, 2).to(dev))


steps = {"dense": lambda: sdpa(q, k, v, "cudnn", causal=False),
         "sfa16": lambda: head.sfa_decode_triton(q, caches[16], scale=scale),
         "sfa8": lambda: head.sfa_decode_triton(q, caches[8], scale=scale),
         "focus_top2": lambda: focus_decode(q, k, v, bits, window=128, scale=scale)}
replays = {}
with skip_nan_checks():
    for name, fn in steps.items():
        replays[name] = graphed(fn)


def timed(replay, warm_ms):
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1000 < warm_ms:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    return measure(replay, dev, warmup=3, reps=50, budget_s=1.0).ms


rows = []
for round_ in range(2):
    for warm_ms in (0, 100, 400):
        for name, replay in replays.items():
            time.sleep(2.0)
            ms = timed(replay, warm_ms)
            rows.append(dict(step=name, warm_ms=warm_ms, idle_s=2.0, round=round_, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
    for name, replay in replays.items():
        ms = timed(replay, 0)
        rows.append(dict(step=name, warm_ms=0, idle_s=0, round=round_, ms=ms))
        print(json.dumps(rows[-1]), flush=True)
summary = {}
for r in rows:
    summary.setdefault(f"{r['step']} idle {r['idle_s']} warm {r['warm_ms']}", []).append(r["ms"])
summary = {key: statistics.median(v) for key, v in summary.items()}
print(json.dumps(summary, indent=1))
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows, summary=summary),
          open(os.path.join(out_dir, "warm_probe.json"), "w"), indent=1)
