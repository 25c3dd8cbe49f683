"""Focus v19 profile (H200, bf16, B=1, H=8, D=128, w=128, K=8, the bench's groups, backend sdpa): v14's share of one
forward outside attention, with v19's kernels named: packing is the gather or the scatter into the sorted layouts,
and the layout's kernels (the keys, the runs, the placing, the float16 copies' maxima) count as layout, as the
PyTorch ops they replace did. Run once per code version (PYTHONPATH picks it): `profile_share.py LABEL LENGTH...`.

Per case: the median time (L2 flushed, the bench's `measure`), then one profiled call whose kernels are summed by
kind. Writes $OUT/profile_share_LABEL.json."""
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

H, D, W, K = 8, 128, 128, 8
KINDS = (("attention", ("cudnn", "flash", "_fwd_kernel")), ("packing", ("_gather_rows", "_scatter_rows")),
         ("merge", ("_merge",)))


def kind(name):
    return next((label for label, marks in KINDS if any(mark in name for mark in marks)), "layout")


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
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            sums[kind(e["name"])] = sums.get(kind(e["name"]), 0.0) + e["dur"] / 1000
            names[e["name"][:60]] = names.get(e["name"][:60], 0.0) + e["dur"] / 1000
    top = dict(sorted(((a, round(b, 4)) for a, b in names.items()), key=lambda x: -x[1])[:16])
    return {a: round(b, 4) for a, b in sums.items()}, top, len([e for e in events if e.get("cat") == "kernel"])


label, lengths = sys.argv[1], [int(a) for a in sys.argv[2:]]
results = {}
with sa.skip_nan_checks():
    for length in lengths:
        q, k, v = (torch.randn(1, H, length, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dense = measure(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                        torch.device("cuda"), reps=10, budget_s=1).ms
        for top in (1, 2):
            groups = FocusGroups.routed(balanced_groups(length, K, top).to("cuda"), K)
            call = lambda: focus_attention(q, k, v, groups, window=W, backend="sdpa")
            ms = measure(call, torch.device("cuda"), reps=10, budget_s=1).ms
            sums, top_kernels, launches = kernels_of(call)
            outside = sums.get("packing", 0) + sums.get("merge", 0) + sums.get("layout", 0)
            row = {"ms": round(ms, 4), "cudnn_ms": round(dense, 4), "x_cudnn": round(dense / ms, 3),
                   "kernels_ms": sums, "kernel_sum_ms": round(sum(sums.values()), 4), "launches": launches,
                   "share_outside_attention": round(outside / ms, 4),
                   "share_without_packing": round((outside - sums.get("packing", 0)) / ms, 4),
                   "top_kernels_ms": top_kernels}
            key = f"{label}_{length // 1024}K_top{top}"
            results[key] = row
            print(key, json.dumps({a: b for a, b in row.items() if a != "top_kernels_ms"}), flush=True)
        del q, k, v
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), f"profile_share_{label}.json"), "w"), indent=1)
