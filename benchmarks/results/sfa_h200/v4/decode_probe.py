"""Device probe (not a library file): decode-kernel streaming at 128K, GQA 32/8, D=128, bf16, CUDA-graph replays.
Focus decode with every key attended (window >= Tk) and with K=8 top-1/top-2 groups; SFA decode k=8/16 under a
few split-K plans (BLOCK_N, warps, programs per SM). Prints ms and effective TB/s of the bytes each must read."""
import json, os, sys
import torch
import torch.nn.functional as F
from sieve_attn import skip_nan_checks
from sieve_attn.bench.timing import measure, graphed
from sieve_attn.ops import split_k
from sieve_attn.ops.focus import decode as fdec
from sieve_attn.ops.focus.reference import group_bits
from sieve_attn.ops.sfa import decode as sdec
from sieve_attn.ops.sfa.cache import SFAKeyCache

dev = torch.device("cuda"); torch.manual_seed(0)
B, HQ, HKV, D, T = 1, 32, 8, 128, 128 * 1024
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
rows = []
def t(name, fn, nbytes):
    ms = measure(graphed(fn), dev, warmup=3, reps=30, budget_s=1.0).ms
    rows.append(dict(name=name, ms=ms, tbps=nbytes / ms / 1e9))
    print(f"{name:55s} {ms:.4f} ms  {nbytes / ms / 1e9:.2f} TB/s", flush=True)
kv_bytes = 2 * B * HKV * T * D * 2
t("dense sdpa decode", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), kv_bytes)
for name, window, ids in [("focus all keys (window>=T)", T, torch.zeros(B, T, 1, dtype=torch.long)),
                          ("focus K8 top1 w128", 128, torch.randint(0, 8, (B, T, 1))),
                          ("focus K8 top2 w128", 128, torch.rand(B, T, 8).argsort(-1)[..., :2])]:
    ids = ids.to(dev); bits = group_bits(ids)
    frac = float(((bits[:, -1:] & bits) != 0).float().mean())
    out, _ = fdec.focus_decode(q, k, v, bits, window=window, scale=D ** -0.5)
    if "all" in name:
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        print("  all-keys max err vs fp32 sdpa:", (out.float() - ref).abs().max().item())
    t(f"{name} (attends {frac:.3f})", lambda: fdec.focus_decode(q, k, v, bits, window=window, scale=D ** -0.5),
      kv_bytes * frac)
for topk in (8, 16):
    cache = SFAKeyCache(B, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
    cache.append(k, v)
    nbytes = cache.allocated_bytes()
    base = (split_k.BLOCK_N, sdec._NUM_WARPS, sdec._NUM_STAGES, split_k._PROGRAMS_PER_SM)
    for bn, warps, stages, pps in [base, (64, 4, 3, 8), (128, 4, 2, 8), (64, 8, 2, 8), (128, 8, 2, 8),
                                   (64, 4, 2, 4), (64, 4, 2, 16), (32, 4, 2, 8), (32, 2, 2, 16)]:
        split_k.BLOCK_N, sdec._NUM_WARPS, sdec._NUM_STAGES, split_k._PROGRAMS_PER_SM = bn, warps, stages, pps
        try:
            with skip_nan_checks():
                ref = sdec.sfa_decode(q, cache, backend="reference")[0] if (bn, warps, stages, pps) == base else ref
                got = sdec.sfa_decode(q, cache, backend="triton")[0]
            err = (got.float() - ref.float()).abs().max().item()
            t(f"sfa k{topk} BLOCK_N={bn} warps={warps} stages={stages} pps={pps} err={err:.1e}",
              lambda: sdec.sfa_decode_triton(q, cache, scale=D ** -0.5), nbytes)
        except Exception as e:
            print("fail", bn, warps, stages, pps, repr(e)[:200])
    split_k.BLOCK_N, sdec._NUM_WARPS, sdec._NUM_STAGES, split_k._PROGRAMS_PER_SM = base
json.dump(rows, open(os.path.join(sys.argv[1], "decode_probe.json"), "w"), indent=1)
