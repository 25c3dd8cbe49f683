"""Device probe (v10, session 26; not a library file): where a decode step's time goes. Replays the CUDA graph of one
step (SFA decode 128K k=16 D=128 GQA 32/8 bf16; dense SDPA decode, cuDNN and flash) under the CUDA
profiler, each replay after an L2 flush as the bench does (sieve_attn.bench.timing), and prints per kernel its
median duration and the median gap before it (from the previous kernel's end; the first kernel's from the flush's
end). Also times each step with two flushes: the bench's (a 256 MiB write, which leaves up to 60 MB of dirty lines in
L2 for the step to write back) and a read flush (a 256 MiB sum: clean lines), to size that effect on both sides.
Usage: python timeline.py OUT. Writes OUT/timeline.json."""
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import sdpa
from sieve_attn.bench.timing import graphed
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.decode import sfa_decode_triton

out_dir = sys.argv[1]
dev = torch.device("cuda")
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, 128
q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
cache = SFAKeyCache(1, HKV, D, topk=16, dtype=torch.bfloat16, device=dev, capacity=T)
cache.append(k, v)
steps = {"sfa_k16": lambda: sfa_decode_triton(q, cache, scale=D ** -0.5),
         "dense_cudnn": lambda: sdpa(q, k, v, "cudnn", causal=False),
         "dense_flash": lambda: sdpa(q, k, v, "flash", causal=False)}
flush_w = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
flush_r = torch.ones(64 * 2 ** 20, dtype=torch.float32, device=dev)


def write_flush():
    flush_w.zero_()


def read_flush():
    flush_r.sum()


def event_ms(replay, flush, reps=60):
    pairs = []
    for _ in range(reps):
        flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); replay(); e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs[5:])


result = {}
with skip_nan_checks():
    for name, fn in steps.items():
        replay = graphed(fn)
        for _ in range(5):
            replay()
        row = {"write_flush_ms": event_ms(replay, write_flush), "read_flush_ms": event_ms(replay, read_flush)}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                write_flush(); replay()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        # group: each flush kernel starts a replay
        replays, current = [], None
        for e in kernels:
            if "fill" in e.name.lower():  # the flush (zero_ launches a fill kernel)
                current = {"flush_end": e.time_range.end, "kernels": []}
                replays.append(current)
            elif current is not None:
                current["kernels"].append((e.name[:60], e.time_range.start, e.time_range.end))
        per = {}
        for rp in replays[3:]:
            prev = rp["flush_end"]
            for i, (kname, s, e) in enumerate(rp["kernels"]):
                d = per.setdefault(f"{i}:{kname}", {"dur": [], "gap": []})
                d["dur"].append(e - s); d["gap"].append(s - prev); prev = e
        row["kernels_us"] = {kn: {"dur": statistics.median(d["dur"]), "gap_before": statistics.median(d["gap"]),
                                  "n": len(d["dur"])} for kn, d in per.items()}
        result[name] = row
        print(name, json.dumps(row, indent=1))
json.dump(result, open(f"{out_dir}/timeline.json", "w"), indent=1)
