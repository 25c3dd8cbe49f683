"""Device probe: split-K plans of the compacting Focus decode kernel at 128K, GQA 32/8, D=128, bf16, K=8 random
top-1 / top-2 groups, window 128; CUDA-graph replays; each plan checked against the default plan's output."""
import json, os, sys
import torch
from sieve_attn.bench.timing import measure, graphed
from sieve_attn.ops import split_k
from sieve_attn.ops.focus import decode as fdec
from sieve_attn.ops.focus.reference import group_bits

dev = torch.device("cuda"); torch.manual_seed(0)
B, HQ, HKV, D, T = 1, 32, 8, 128, 128 * 1024
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
rows = []
base = (split_k.BLOCK_N, fdec._NUM_WARPS, fdec._NUM_STAGES, split_k._PROGRAMS_PER_SM)
plans = [base, (64, 4, 2, 8), (64, 8, 3, 8), (32, 4, 3, 8), (32, 4, 3, 16), (128, 4, 3, 8), (128, 8, 2, 8),
         (64, 4, 3, 16)]
for name, ids in [("top1", torch.randint(0, 8, (B, T, 1))), ("top2", torch.rand(B, T, 8).argsort(-1)[..., :2])]:
    bits = group_bits(ids.to(dev))
    ref = None
    for plan in plans:
        split_k.BLOCK_N, fdec._NUM_WARPS, fdec._NUM_STAGES, split_k._PROGRAMS_PER_SM = plan
        try:
            fn = lambda: fdec.focus_decode(q, k, v, bits, window=128, scale=D ** -0.5)
            out = fn()[0]
            ref = out if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            ms = measure(graphed(fn), dev, warmup=3, reps=20, budget_s=0.5).ms
            rows.append(dict(groups=name, plan=plan, ms=ms, err_vs_default=err))
            print(f"{name} BLOCK_N={plan[0]} warps={plan[1]} stages={plan[2]} pps={plan[3]}: {ms:.4f} ms err {err:.1e}",
                  flush=True)
        except Exception as e:
            print("fail", name, plan, repr(e)[:200], flush=True)
    split_k.BLOCK_N, fdec._NUM_WARPS, fdec._NUM_STAGES, split_k._PROGRAMS_PER_SM = base
json.dump(rows, open(os.path.join(sys.argv[1], "focus_decode_probe.json"), "w"), indent=1)
