"""The sdpa backend (batched cuDNN groups + Triton window kernel) at 64K and 256K, top-1: per-kernel device times,
and the batched cuDNN call alone on already packed inputs (the floor of this design)."""
import json, os, time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import measure
from sieve_attn.ops.focus.groups import FocusGroups
from sieve_attn.ops.focus.attention import focus_attention
dev = torch.device("cuda")
res = {}
H, D = 8, 128
for T in (65536, 262144):
    q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for K in (8, 16):
        raw = balanced_groups(T, K, 1).to(dev)
        pre = FocusGroups.of(raw, 1, T, dev)
        r = {}
        with sa.skip_nan_checks():
            for backend in ("sdpa", "triton"):
                r[backend + "_raw_ms"] = measure(lambda: focus_attention(q, k, v, raw, backend=backend), dev, reps=10, budget_s=1).ms
                r[backend + "_pre_ms"] = measure(lambda: focus_attention(q, k, v, pre, backend=backend), dev, reps=10, budget_s=1).ms
            packed = [torch.randn(K, H, T // K, D, device=dev, dtype=torch.bfloat16) for _ in range(3)]
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                r["cudnn_packed_ms"] = measure(lambda: F.scaled_dot_product_attention(*packed, is_causal=True), dev, reps=10, budget_s=1).ms
                r["cudnn_dense_ms"] = measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, reps=5, budget_s=1).ms
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                focus_attention(q, k, v, pre, backend="sdpa")
            r["sdpa_host_ms_queued"] = (time.perf_counter() - t0) / 5 * 1000
            torch.cuda.synchronize()
            r["sdpa_wall_ms_queued"] = (time.perf_counter() - t0) / 5 * 1000
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    focus_attention(q, k, v, pre, backend="sdpa")
                torch.cuda.synchronize()
        kern = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kern[e.name[:100]] = kern.get(e.name[:100], 0) + e.time_range.elapsed_us() / 3 / 1000
        r["kernels_ms"] = {a: round(b, 4) for a, b in sorted(kern.items(), key=lambda x: -x[1])[:16]}
        r["kernels_total_ms"] = round(sum(kern.values()), 4)
        res[f"T{T}_K{K}"] = r
        print(f"T={T} K={K}:", json.dumps(r, indent=1), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
json.dump(res, open(os.environ["OUT"] + "/profile_sdpa.json", "w"), indent=1)
