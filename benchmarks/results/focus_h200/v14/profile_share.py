"""Focus v14 profile (H200, bf16, B=1, H=8, D=128, w=128, K=8, the bench's groups): the share of one forward's time
spent outside attention, for the issue's "routing, sorting and merging at most 10% at 64K and above". Cases: top-1
and top-2 on the sdpa backend at the lengths given (default 65536 262144), top-1 on the Triton backend at 8K.

Per case: the median time (L2 flushed, the bench's `measure`), then one profiled call whose kernels are summed by
kind: attention (cuDNN, the Triton window or group kernels), packing (the gather into the sorted layout), merge
(the merge kernel), layout (everything else: the sort, its index and scan ops, the float16 copies' maxima, copies to
the host). Routing (the router's scores and top-k) happens in the model, before this call, and is not here.
Writes $OUT/profile_share.json."""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import measure
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus.groups import FocusGroups

dev = torch.device("cuda")
H, D, W, K = 8, 128, 128, 8
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def kind(name):
    if "cudnn" in name or "flash" in name or name.startswith("_fwd_kernel"):
        return "attention"
    if name.startswith("_gather_rows"):
        return "packing"
    if name.startswith("_merge"):
        return "merge"
    return "layout"


def kernels_of(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    sums, names = {}, {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            sums[kind(e["name"])] = sums.get(kind(e["name"]), 0.0) + e["dur"] / 1000
            names[e["name"][:60]] = names.get(e["name"][:60], 0.0) + e["dur"] / 1000
    top = dict(sorted(((a, round(b, 4)) for a, b in names.items()), key=lambda x: -x[1])[:14])
    return {a: round(b, 4) for a, b in sums.items()}, top


results = {}
cases = [(8192, 1, "triton")] + [(int(a), top, "sdpa") for a in (sys.argv[1:] or (65536, 262144)) for top in (1, 2)]
with sa.skip_nan_checks():
    for length, top, backend in cases:
        q, k, v = (torch.randn(1, H, length, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        dense = measure(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), dev,
                        reps=10, budget_s=1).ms
        groups = FocusGroups.routed(balanced_groups(length, K, top).to(dev), K)
        call = lambda: focus_attention(q, k, v, groups, window=W, backend=backend)
        ms = measure(call, dev, reps=10, budget_s=1).ms
        sums, top_kernels = kernels_of(call)
        outside = sums.get("packing", 0) + sums.get("merge", 0) + sums.get("layout", 0)
        row = {"ms": round(ms, 4), "cudnn_ms": round(dense, 4), "x_cudnn": round(dense / ms, 3), "kernels_ms": sums,
               "share_outside_attention": round(outside / ms, 4),
               "share_without_packing": round((outside - sums.get("packing", 0)) / ms, 4),
               "top_kernels_ms": top_kernels}
        key = f"{length // 1024}K_top{top}_{backend}"
        results[key] = row
        print(key, json.dumps({a: b for a, b in row.items() if a != "top_kernels_ms"}), flush=True)
        del q, k, v
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "profile_share.json"), "w"), indent=1)
