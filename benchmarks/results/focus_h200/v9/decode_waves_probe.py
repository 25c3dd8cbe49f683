"""Device probe (not a library file): programs per SM of the Focus decode kernel against the programs an SM holds
at once. Offline sm_90 compile (triton 3.6): 156 registers per thread at 4 warps and 2 stages, so 3 programs fit an
SM and the default 8 per SM run as 2.67 waves; 197 registers at 3 stages, 2 fit. 128K cached tokens, GQA 32/8,
D=128, bf16, K=8 random top-1 / top-2 groups, window 128, CUDA-graph replays with a cold L2, against dense
SDPA-cuDNN decode; each plan's output checked against the float32 reference (max error) in the same run. It ran
(call A) when the programs per SM were split_k's default, which it set; the plan constants now live in the decode
module, which it sets instead."""
import json, os, sys
import torch
from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus import decode as fdec
from sieve_attn.ops.focus.reference import focus_attention_reference, group_bits

dev = torch.device("cuda"); torch.manual_seed(0)
B, HQ, HKV, D, T = 1, 32, 8, 128, 128 * 1024
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
backend = first_working_sdpa(q, k, v, causal=False)
dense_ms = measure(graphed(lambda: sdpa(q, k, v, backend, causal=False)), dev, warmup=3, reps=50, budget_s=1.0).ms
print(f"dense sdpa decode ({backend}) {dense_ms:.4f} ms", flush=True)
rows = [dict(name="dense", backend=backend, ms=dense_ms)]
base = (fdec._NUM_STAGES, fdec._PROGRAMS_PER_SM)
plans = [base, (2, 3), (2, 6), (2, 9), (2, 12), (2, 4), (3, 2), (3, 4), (3, 6), base]
for name, ids in [("top1", torch.randint(0, 8, (B, T, 1))), ("top2", torch.rand(B, T, 8).argsort(-1)[..., :2])]:
    ids = ids.to(dev)
    bits = group_bits(ids)
    ref, _ = focus_attention_reference(q.float(), k.float(), v.float(), ids, window=128, causal=True,
                                       scale=D ** -0.5)
    for stages, pps in plans:
        fdec._NUM_STAGES, fdec._PROGRAMS_PER_SM = stages, pps
        fn = lambda: fdec.focus_decode(q, k, v, bits, window=128, scale=D ** -0.5)
        err = (fn()[0].float() - ref).abs().max().item()
        assert err < 1e-2, f"wrong output: {err}"
        ms = measure(graphed(fn), dev, warmup=3, reps=50, budget_s=1.0).ms
        rows.append(dict(name=name, stages=stages, pps=pps, ms=ms, err=err, x_dense=dense_ms / ms))
        print(f"{name} stages={stages} pps={pps}: {ms:.4f} ms x dense {dense_ms / ms:.3f} err {err:.1e}", flush=True)
    fdec._NUM_STAGES, fdec._PROGRAMS_PER_SM = base
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               rows=rows), open(os.path.join(sys.argv[1], "decode_waves_probe.json"), "w"), indent=1)
