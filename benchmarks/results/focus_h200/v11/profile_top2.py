"""Focus v11 profile (H200, bf16, B=1, H=8, D=128, w=128, K=8, top-2): where the time of a forward goes, for the
sdpa backend (inclusion-exclusion) and the Triton kernels, at 8K and 64K, with both spreads of the bench's groups.
Per case: the median time (L2 flushed), the host's time to queue one call, the device time per kernel name, and
the host ops that take longest. Arguments: the lengths (default 8192 65536). Writes $OUT/profile_top2.json."""
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import measure
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus.groups import FocusGroups

dev = torch.device("cuda")
H, D, W, K = 8, 128, 128, 8


def timed(fn, reps=10):
    return round(measure(fn, dev, reps=reps, budget_s=1).ms, 4)


def queued(fn, n=5):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1000
    torch.cuda.synchronize()
    return {"host_ms_queued": round(host, 4), "wall_ms": round((time.perf_counter() - start) / n * 1000, 4)}


def breakdown(fn, n=3, top=16):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:90]
            kernels[name] = kernels.get(name, 0) + event.time_range.elapsed_us() / n / 1000
    host = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:top]
    return {"kernels_total_ms": round(sum(kernels.values()), 4),
            "kernels_ms": {a: round(b, 4) for a, b in sorted(kernels.items(), key=lambda x: -x[1])[:top]},
            "host_ops_ms": {e.key[:90]: round(e.cpu_time_total / n / 1000, 4) for e in host}}


results = {}
with sa.skip_nan_checks():
    for length in [int(a) for a in sys.argv[1:]] or (8192, 65536):
        q, k, v = (torch.randn(1, H, length, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        dense = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        for spread in ("combinations", "adjacent"):
            groups = FocusGroups.of(balanced_groups(length, K, 2, spread=spread).to(dev), 1, length, dev)
            for backend in ("sdpa", "triton"):
                call = lambda: focus_attention(q, k, v, groups, window=W, backend=backend)
                row = {"ms": timed(call), "cudnn_ms": dense, **queued(call), **breakdown(call)}
                row["x_cudnn"] = round(dense / row["ms"], 3)
                key = f"{length // 1024}K_{spread}_{backend}"
                results[key] = row
                print(key, json.dumps({a: row[a] for a in ("ms", "cudnn_ms", "x_cudnn", "host_ms_queued",
                                                           "kernels_total_ms")}), flush=True)
        del q, k, v
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "profile_top2.json"), "w"), indent=1)
