"""Focus v19 trace (H200, bf16, B=1, H=8, D=128, w=128, K=8, the bench's groups, backend sdpa, 64K tokens): where a
forward's time goes when calls are queued back to back as the bench times them (L2 flush, call, flush, call, ...).
Four calls of top-1 and of top-2 under the profiler (host and device); per call, from its first kernel's start to
the next call's flush: the kernels' busy time, the device's idle gaps longer than 5 us and what the host was doing
in them (the host op running at the gap's start). Run once per code version (PYTHONPATH picks it): `trace_calls.py
LABEL`. Writes $OUT/trace_summary_LABEL.json and the gzipped traces."""
import gzip
import json
import os
import shutil
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import L2_FLUSH_BYTES
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus.groups import FocusGroups

OUT = os.environ.get("OUT", "/tmp")
LABEL = sys.argv[1]
H, D, W, K, T = 8, 128, 128, 8, 65536
summary = {}
flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
with sa.skip_nan_checks():
    q, k, v = (torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for top in (1, 2):
        groups = FocusGroups.routed(balanced_groups(T, K, top).to("cuda"), K)
        call = lambda: focus_attention(q, k, v, groups, window=W, backend="sdpa")
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                flush.zero_()
                call()
            torch.cuda.synchronize()
        path = os.path.join(tempfile.gettempdir(), f"trace_top{top}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(os.path.join(OUT, f"trace_{LABEL}_top{top}.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        events = json.load(open(path))["traceEvents"]
        kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                       "gpu_memset")),
                         key=lambda e: e["ts"])
        host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        flushes = [i for i, e in enumerate(kernels) if "fill" in e["name"].lower() and e["dur"] > 20]
        calls = []
        for a, b in zip(flushes, flushes[1:] + [len(kernels)]):
            run = kernels[a + 1:b]
            if not run:
                continue
            start, end = run[0]["ts"], max(e["ts"] + e["dur"] for e in run)
            gaps = []
            for prev, nxt in zip(run, run[1:]):
                gap = nxt["ts"] - (prev["ts"] + prev["dur"])
                if gap > 5:
                    doing = [h["name"] for h in host if h["ts"] <= prev["ts"] + prev["dur"] <= h["ts"] + h["dur"]]
                    gaps.append({"us": round(gap, 1), "after": prev["name"][:50], "before": nxt["name"][:50],
                                 "host": doing[-3:]})
            calls.append({"span_ms": round((end - start) / 1000, 4),
                          "busy_ms": round(sum(e["dur"] for e in run) / 1000, 4),
                          "idle_ms": round(sum(g["us"] for g in gaps) / 1000, 4), "gaps": gaps})
        summary[f"top{top}"] = calls
        print(f"{LABEL} top{top}", [(c["span_ms"], c["busy_ms"], c["idle_ms"]) for c in calls], flush=True)
json.dump(summary, open(os.path.join(OUT, f"trace_summary_{LABEL}.json"), "w"), indent=1)
