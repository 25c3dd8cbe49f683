"""Session 34, call H: per-replay times of one graphed decode step (128K cached tokens, GQA 32/8, D = 128, bf16, each
replay after the bench's L2 write flush), in series of 200 after half a second of idle: does the SFA step run slower
in its first replays (warm-up), or is its time bimodal? Call G found the gated bench's SFA rows at 128K 13% slower
with 3 warm-up calls and 10 timed than with 200 and 50, while dense, Focus and SFA at 32K (no pool) did not move."""
import statistics, sys, time, json

import torch
import torch.nn.functional as F

from sieve_attn import skip_nan_checks
from sieve_attn.bench.timing import L2_FLUSH_BYTES, graphed
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.decode import sfa_decode

out = sys.argv[1]
torch.manual_seed(0)
dev, T = "cuda", 131072
q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
caches = []  # a graph keeps no input alive
steps = {"dense": graphed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))}
for topk in (16, 8):
    cache = SFAKeyCache(1, 8, 128, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
    cache.append(k, v)
    caches.append(cache)
    with skip_nan_checks():
        steps[f"sfa{topk}"] = graphed(lambda cache=cache: sfa_decode(q, cache))
result = {}
for trial in range(3):
    for name, replay in steps.items():
        torch.cuda.synchronize()
        time.sleep(0.5)
        events = []
        for _ in range(200):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); replay(); end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        us = [round(s.elapsed_time(e) * 1000, 1) for s, e in events]
        result[f"{name}_{trial}"] = us
        print(name, trial, "first 10:", us[:10], "| median 0-10 %.1f, 10-50 %.1f, 50-200 %.1f, min %.1f, max %.1f" % (
            statistics.median(us[:10]), statistics.median(us[10:50]), statistics.median(us[50:]), min(us), max(us)),
            flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), us=result), open(out, "w"))
