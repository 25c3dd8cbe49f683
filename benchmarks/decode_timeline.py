"""Where a decode step's time goes on one GPU (a device probe, not a test): each step's CUDA graph replayed under the
CUDA profiler, after the bench's L2 flush, with per kernel its median duration and the median gap before it (from
the previous kernel's end; the first kernel's from the flush's end), beside dense SDPA-cuDNN decode over the same
cache. The steps are those of ``decode_probe.py`` (``--kernel sfa|focus``, ``--topk``, ``--groups``; the library's
``decode`` module), gated the same way first (a FAIL prints no timeline).

    python benchmarks/decode_timeline.py --kernel focus --topk 1,2 --out OUT
Writes OUT/decode_timeline.json: per step, {"kernel index:name": {"dur_us", "gap_before_us", "n"}}.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from decode_probe import add_step_arguments, dense_step, gate_and_capture, step_cases, step_inputs
from sieve_attn.bench.common import length_list
from sieve_attn.bench.timing import L2_FLUSH_BYTES


def kernel_timeline(replay, flush: torch.Tensor, replays: int = 20, skipped: int = 3) -> dict:
    """{"i:kernel name": {"dur_us", "gap_before_us", "n"}}: medians over the replays after the first ``skipped``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush.zero_()
            replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    runs, current = [], None
    for event in kernels:
        if "fill" in event.name.lower():  # the flush's zero_ is a fill kernel: a replay starts after it
            current = {"flush_end": event.time_range.end, "kernels": []}
            runs.append(current)
        elif current is not None:
            current["kernels"].append((event.name[:60], event.time_range.start, event.time_range.end))
    per = {}
    for run in runs[skipped:]:
        previous = run["flush_end"]
        for index, (name, start, end) in enumerate(run["kernels"]):
            row = per.setdefault(f"{index}:{name}", {"dur": [], "gap": []})
            row["dur"].append(end - start)
            row["gap"].append(start - previous)
            previous = end
    return {name: {"dur_us": statistics.median(r["dur"]), "gap_before_us": statistics.median(r["gap"]),
                   "n": len(r["dur"])} for name, r in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for decode_timeline.json")
    parser.add_argument("--length", type=length_list, default=(131072,), help="cached tokens (one length)")
    add_step_arguments(parser)
    args = parser.parse_args()
    device, length = torch.device("cuda"), args.length[0]
    q, k, v = step_inputs(args, length, device)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    result = {"dense": kernel_timeline(dense_step(q, k, v), flush)}
    for topk, step, exact, low_error in step_cases(args, q, k, v):
        row, replay = gate_and_capture(args.kernel, "decode", step, exact, low_error)
        print(("" if row.get("ok") else "FAIL ") + json.dumps(row), flush=True)
        if replay is not None:
            result[f"{args.kernel} topk={topk}"] = kernel_timeline(replay, flush)
    for name, kernels in result.items():
        print(name, json.dumps(kernels, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_timeline.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, kernel=args.kernel, T=length,
             D=args.head_dim, heads=list(args.heads), batch=args.batch, steps=result), indent=1))


if __name__ == "__main__":
    main()
