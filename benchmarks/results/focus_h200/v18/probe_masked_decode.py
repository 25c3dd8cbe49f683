"""Device probe (v18, session 21): does a masked dense decode beat the Triton decode kernel on short caches?

auto sends every decode step to the Triton kernel (attention._resolve), while the gated bench puts that kernel
below unmasked dense decode at 8K (0.72-0.88x). Unmasked dense does not compute Focus; the dense alternative that
does is SDPA with the pattern as a mask. Here that path is timed at its best: the query's row of the pattern
built from the validated group bits in three torch ops ((bits & query bits) != 0, or inside the window), then
masked SDPA, all in one CUDA graph. Against the Triton kernel's replay, both checked against the float32
reference; GQA 32/8, B=1, K=8, window 128, bf16, 1K-32K cached tokens, D 64 and 128, top-1 and top-2
(combinations). Writes OUT/masked_decode.json."""
import json
import os
import sys

import torch

from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus import decode
from sieve_attn.ops.focus.reference import focus_attention_reference, group_bits
from sieve_attn.ops.masked_sdpa import masked_sdpa

dev = torch.device("cuda")
HQ, HKV, K, W = 32, 8, 8, 128
rows = []
for head_dim in (64, 128):
    for length in (1024, 2048, 4096, 8192, 16384, 32768):
        torch.manual_seed(0)
        q = torch.randn(1, HQ, 1, head_dim, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, HKV, length, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
        scale = head_dim ** -0.5
        backend = first_working_sdpa(q, k, v, causal=False)
        unmasked_ms = measure(graphed(lambda: sdpa(q, k, v, backend, causal=False)), dev, reps=50, budget_s=1.0).ms
        positions = torch.arange(length, device=dev)
        for top_k in (1, 2):
            ids = balanced_groups(length, K, top_k, spread="combinations").to(dev)
            bits = group_bits(ids)
            ref, _ = focus_attention_reference(q.float(), k.float(), v.float(), ids, window=W, causal=True,
                                               scale=scale)

            def masked():
                allowed = ((bits & bits[:, -1:]) != 0) | (positions >= length - 1 - W)
                return masked_sdpa(q, k, v, allowed[:, None, None], scale=scale)

            def kernel():
                return decode.focus_decode(q, k, v, bits, window=W, scale=scale)[0]

            row = dict(D=head_dim, T=length, top_k=top_k, unmasked_dense_backend=backend, unmasked_dense_ms=unmasked_ms)
            for name, fn in (("masked_sdpa", masked), ("triton", kernel)):
                err = (fn().float() - ref).abs().max().item()
                row[f"{name}_err"] = err
                row[f"{name}_ms"] = measure(graphed(fn), dev, reps=50, budget_s=1.0).ms if err < 2e-2 else None
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               rows=rows), open(os.path.join(sys.argv[1], "masked_decode.json"), "w"), indent=1)
