"""Focus v13 timeline (H200, bf16, B=1, H=8, D=128, w=128, K=8, sdpa backend, combinations groups): when each kernel
of one forward runs, on which stream, and when the host waits for the device. Cases: top-1 and top-2 at the lengths
given (default 65536), each as the library runs it ("side": the window kernel on a side stream) and with the side
stream replaced by the current one ("serial", a monkeypatch of this script only), to price the overlap.

Per case: the median time (L2 flushed, the bench's `measure`), then one profiled call: the kernels (start and length
in us from the call's first host op, stream), the host's waits (synchronize calls), the device's busy time (union of
kernel intervals) and its idle gaps over 15 us with the kernels around them. Writes $OUT/profile_timeline.json."""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import measure
from sieve_attn.ops import side_stream
from sieve_attn.ops.focus import decomposed
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus.groups import FocusGroups

dev = torch.device("cuda")
H, D, W, K = 8, 128, 128, 8
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class Serial(side_stream.SideStream):
    """The side stream's work on the current stream."""

    def __enter__(self):
        return self

    def run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def join(self):
        pass


def trace_of(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    events = [e for e in events if e.get("ph") == "X"]
    start = min(e["ts"] for e in events if e.get("cat") == "cpu_op")
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    kernels = [[round(e["ts"] - start, 1), round(e["dur"], 1), e.get("args", {}).get("stream"), e["name"][:48]]
               for e in device]
    waits = [[round(e["ts"] - start, 1), round(e["dur"], 1), e["name"]] for e in events
             if e.get("cat") == "cuda_runtime" and "ynchronize" in e["name"] and e["dur"] > 5]
    busy, end, gaps = 0.0, None, []
    for k in kernels:
        s, d = k[0], k[1]
        if end is not None and s > end + 15:
            gaps.append([round(end, 1), round(s - end, 1), k[3]])
        if end is None or s > end:
            busy += d
            end = s + d
        elif s + d > end:
            busy += s + d - end
            end = s + d
    return {"device_busy_us": round(busy, 1), "last_kernel_end_us": round(end or 0.0, 1), "gaps": gaps,
            "host_waits": waits, "kernels": kernels}


results = {}
with sa.skip_nan_checks():
    for length in [int(a) for a in sys.argv[1:]] or (65536,):
        q, k, v = (torch.randn(1, H, length, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        dense = measure(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), dev,
                        reps=10, budget_s=1).ms
        for top in (1, 2):
            groups = FocusGroups.of(balanced_groups(length, K, top).to(dev), 1, length, dev)
            call = lambda: focus_attention(q, k, v, groups, window=W, backend="sdpa")
            for mode in ("side", "serial"):
                decomposed.SideStream = Serial if mode == "serial" else side_stream.SideStream
                try:
                    ms = measure(call, dev, reps=10, budget_s=1).ms
                    row = {"ms": round(ms, 4), "cudnn_ms": round(dense, 4), "x_cudnn": round(dense / ms, 3),
                           **trace_of(call)}
                finally:
                    decomposed.SideStream = side_stream.SideStream
                key = f"{length // 1024}K_top{top}_{mode}"
                results[key] = row
                print(key, json.dumps({a: row[a] for a in ("ms", "cudnn_ms", "x_cudnn", "device_busy_us",
                                                           "last_kernel_end_us")}), flush=True)
                print("  gaps", json.dumps(row["gaps"])[:600], "\n  waits", json.dumps(row["host_waits"])[:400],
                      flush=True)
        del q, k, v
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "profile_timeline.json"), "w"), indent=0)
