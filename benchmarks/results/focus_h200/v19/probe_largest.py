"""Focus v19 probe (H200): the float16 copies' maxima, PyTorch's reduction against the Triton kernel's plans (rows
per step, programs per launch, warps), bf16 q, k, v [1, 8, T, 128] at T = 64K and 256K. Each plan's result equal
to PyTorch's in the same run; times are medians with the L2 flushed (the bench's `measure`). Writes
$OUT/probe_largest.json."""
import itertools
import json
import os

import torch

from sieve_attn.bench.timing import measure
from sieve_attn.ops import magnitude

device = torch.device("cuda")
results = {}
for length in (65536, 262144):
    tensors = [torch.randn(1, 8, length, 128, device=device, dtype=torch.bfloat16) * (j + 1) for j in range(3)]
    want = magnitude.largest_magnitudes_reference(tensors)
    gigabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    ms = measure(lambda: magnitude.largest_magnitudes_reference(tensors), device, reps=20, budget_s=1).ms
    results[f"{length // 1024}K torch"] = {"ms": round(ms, 4), "TB/s": round(gigabytes / ms, 2)}
    for rows, programs, warps in itertools.product((32, 64, 128), (512, 1024, 2048, 4096), (4, 8)):
        magnitude._ROWS, magnitude._PROGRAMS, magnitude._NUM_WARPS = rows, programs, warps
        assert torch.equal(magnitude.largest_magnitudes_triton(tensors), want)
        ms = measure(lambda: magnitude.largest_magnitudes_triton(tensors), device, reps=20, budget_s=1).ms
        results[f"{length // 1024}K rows {rows} programs {programs} warps {warps}"] = {
            "ms": round(ms, 4), "TB/s": round(gigabytes / ms, 2)}
    best = sorted((v["ms"], k) for k, v in results.items() if k.startswith(f"{length // 1024}K rows"))[:5]
    print(f"{length // 1024}K torch", results[f"{length // 1024}K torch"], "best:", best, flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_largest.json"), "w"), indent=1)
