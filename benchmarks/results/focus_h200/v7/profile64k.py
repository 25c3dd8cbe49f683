"""Where the time of a Focus forward goes at 64K (H200, bf16, H=8, D=128, w=128): per-kernel device times from the
profiler, host time per call, and timings with raw groups (validated per call) vs a pre-validated FocusGroups."""
import json, os, time, torch
from torch.profiler import profile, ProfilerActivity
import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import measure
from sieve_attn.ops.focus.groups import FocusGroups
from sieve_attn.ops.focus.attention import focus_attention
dev = torch.device("cuda")
res = {}
T, H, D = 65536, 8, 128
q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
for K, m in ((8, 1), (16, 1), (8, 2)):
    raw = balanced_groups(T, K, m, spread="adjacent").to(dev)
    pre = FocusGroups.of(raw, 1, T, dev)
    r = {}
    with sa.skip_nan_checks():
        for name, g in (("raw", raw), ("prevalidated", pre)):
            r[name + "_ms"] = measure(lambda: focus_attention(q, k, v, g, backend="triton"), dev, reps=10, budget_s=1).ms
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            focus_attention(q, k, v, pre, backend="triton")
        r["host_ms_per_call_queued"] = (time.perf_counter() - t0) / 5 * 1000
        torch.cuda.synchronize()
        r["wall_ms_per_call_queued"] = (time.perf_counter() - t0) / 5 * 1000
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                focus_attention(q, k, v, pre, backend="triton")
            torch.cuda.synchronize()
    kern = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[e.name[:90]] = kern.get(e.name[:90], 0) + e.time_range.elapsed_us() / 3 / 1000
    r["kernels_ms"] = {a: round(b, 4) for a, b in sorted(kern.items(), key=lambda x: -x[1])[:20]}
    r["kernels_total_ms"] = round(sum(kern.values()), 4)
    res[f"K{K}_top{m}"] = r
    print(f"K={K} top-{m}:", json.dumps(r, indent=1), flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
dense = measure(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), dev, reps=10).ms
res["cudnn_default_sdpa_ms"] = dense
print("dense sdpa (default backend choice)", dense)
json.dump(res, open(os.environ["OUT"] + "/profile64k.json", "w"), indent=1)
