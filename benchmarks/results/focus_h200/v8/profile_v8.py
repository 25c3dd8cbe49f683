"""Where the time goes (H200, bf16, H=8, D=128, w=128, balanced groups), on the current code:
A. 64K K=8 top-1 sdpa forward: total, host time queued, per-kernel device times, and each stage timed alone.
B. 64K K=8 top-2 triton forward: per-kernel.
C. 8K K=8 top-1 forward (triton, sdpa): totals, host time, per-kernel.
D. 64K K=8 top-1 sdpa forward+backward: per-kernel."""
import json, os, sys, time, torch
from torch.profiler import profile, ProfilerActivity
import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import measure
from sieve_attn.ops.focus.groups import FocusGroups
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus import decomposed
from sieve_attn.ops.focus.sdpa_ops import causal_call

dev = torch.device("cuda")
res = {}
H, D, W = 8, 128, 128
out_dir = os.environ.get("OUT", "/tmp")


def t(fn, reps=10):
    return round(measure(fn, dev, reps=reps, budget_s=1).ms, 4)


def kernels(fn, n=3, top=18):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kern = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[e.name[:90]] = kern.get(e.name[:90], 0) + e.time_range.elapsed_us() / n / 1000
    return {"kernels_total_ms": round(sum(kern.values()), 4), "launches": None,
            "kernels_ms": {a: round(b, 4) for a, b in sorted(kern.items(), key=lambda x: -x[1])[:top]}}


def host(fn, n=5):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t0) / n * 1000
    torch.cuda.synchronize()
    return {"host_ms_queued": round(h, 4), "wall_ms_queued": round((time.perf_counter() - t0) / n * 1000, 4)}


def qkv(T):
    return [torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3)]


with sa.skip_nan_checks():
    # A
    T, K = 65536, 8
    q, k, v = qkv(T)
    raw = balanced_groups(T, K, 1).to(dev)
    pre = FocusGroups.of(raw, 1, T, dev)
    f = lambda: focus_attention(q, k, v, pre, window=W, backend="sdpa")
    r = {"total_pre_ms": t(f), "total_raw_ms": t(lambda: focus_attention(q, k, v, raw, window=W, backend="sdpa")),
         "dense_cudnn_ms": t(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), 5)}
    r.update(host(f))
    r["groups_of_ms"] = t(lambda: FocusGroups.of(raw, 1, T, dev))
    r["sorted_of_ms"] = t(lambda: decomposed.SortedGroups.of(pre.ids, pre.num_groups))
    plan = decomposed._Plan(pre, q, k, window=W, causal=True, scale=D ** -0.5)
    r["plan_ms"] = t(lambda: decomposed._Plan(pre, q, k, window=W, causal=True, scale=D ** -0.5))
    r["plan_host"] = host(lambda: decomposed._Plan(pre, q, k, window=W, causal=True, scale=D ** -0.5))
    s = plan.sorted
    r["pack_one_ms"] = t(lambda: s.pack(q))
    qs, ks, vs = s.pack(q), s.pack(k), s.pack(v)
    r["cudnn_packed_ms"] = t(lambda: causal_call(qs, ks, vs, D ** -0.5))
    _, os_, ls_, _ = causal_call(qs, ks, vs, D ** -0.5)
    r["to_tokens_out_ms"] = t(lambda: s.to_tokens(os_))
    r["to_tokens_lse_ms"] = t(lambda: s.to_tokens(ls_.float()))
    r["window_kernel_alone_ms"] = t(lambda: plan.window_kernel.forward(q, k, v))
    r.update(kernels(f))
    res["A_64K_K8_top1_sdpa"] = r
    print("A", json.dumps(r, indent=1), flush=True)

    json.dump(res, open(out_dir + "/profile_v8.json", "w"), indent=1)
    raise SystemExit
    # D: forward + backward
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    go = torch.randn_like(q)

    def fb():
        out, _ = focus_attention(qg, kg, vg, pre, window=W, backend="sdpa", return_lse=True)
        out.backward(go)
    def dense_fb():
        torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(go)
    r = {"fwd_bwd_ms": t(fb, 5), "dense_fwd_bwd_ms": t(dense_fb, 5)}
    r.update(kernels(fb, 2))
    res["D_64K_K8_top1_sdpa_fwd_bwd"] = r
    print("D", json.dumps(r, indent=1), flush=True)
    del qg, kg, vg, go

    # B: top-2 triton
    raw2 = balanced_groups(T, K, 2, spread="adjacent").to(dev)
    pre2 = FocusGroups.of(raw2, 1, T, dev)
    f2 = lambda: focus_attention(q, k, v, pre2, window=W, backend="triton")
    r = {"total_pre_ms": t(f2)}
    r.update(host(f2))
    r.update(kernels(f2))
    res["B_64K_K8_top2_triton"] = r
    print("B", json.dumps(r, indent=1), flush=True)

    # C: 8K
    T = 8192
    q, k, v = qkv(T)
    raw = balanced_groups(T, K, 1).to(dev)
    pre = FocusGroups.of(raw, 1, T, dev)
    r = {"dense_cudnn_ms": t(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))}
    for backend in ("triton", "sdpa"):
        f = lambda: focus_attention(q, k, v, pre, window=W, backend=backend)
        r[backend] = {"total_pre_ms": t(f),
                      "total_raw_ms": t(lambda: focus_attention(q, k, v, raw, window=W, backend=backend)),
                      **host(f), **kernels(f)}
    res["C_8K_K8_top1"] = r
    print("C", json.dumps(r, indent=1), flush=True)

json.dump(res, open(out_dir + "/profile_v8.json", "w"), indent=1)
