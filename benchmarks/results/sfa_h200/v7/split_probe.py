"""Device probe (not a library file): the SFA decode kernel with the output's D columns in SPLIT_D slices, one
program each (decode._SPLIT_D), against the unsliced kernel and dense SDPA decode. GQA 32/8, D=128, bf16, batch 1,
CUDA-graph replays with a cold L2 (sieve_attn.bench.timing). Each variant's output is checked against the PyTorch
reference of sfa_decode in the same run (max abs error against float32 arithmetic on the bf16 inputs) before it is
timed. Writes split_probe.json (rows, registers, spills and shared memory of every compiled variant) to the folder
given. Usage: python split_probe.py OUT [LENGTHS_IN_K] with VARIANTS="split/programs_per_sm ..." in the environment.

A record: it ran (session 23, call A) on the working tree of split_d.diff beside it (decode._SPLIT_D and the kernel's
SPLIT_D), which measured slower and was reverted; apply the diff to run it again."""
import json, os, sys
import torch
import triton
from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.sfa import decode
from sieve_attn.ops.sfa.cache import SFAKeyCache

out_dir = sys.argv[1]
dev = torch.device("cuda"); torch.manual_seed(0)
B, HQ, HKV, D = 1, 32, 8, 128
lengths = [int(x) * 1024 for x in (sys.argv[2] if len(sys.argv) > 2 else "128").split(",")]
variants = [tuple(int(x) for x in v.split("/")) for v in os.environ.get("VARIANTS", "1/8 2/16").split()]
rows = []


def timed(name, fn, nbytes, **extra):
    ms = measure(graphed(fn), dev, warmup=3, reps=50, budget_s=1.0).ms
    rows.append(dict(name=name, ms=ms, tbps=nbytes / ms / 1e9, **extra))
    print(f"{name:58s} {ms:.4f} ms  {nbytes / ms / 1e9:.2f} TB/s", flush=True)
    return ms


for T in lengths:
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    backend = first_working_sdpa(q, k, v, causal=False)
    dense_ms = timed(f"T={T} dense sdpa decode ({backend})", lambda: sdpa(q, k, v, backend, causal=False),
                     2 * k.numel() * 2, T=T, kernel="dense")
    for topk in (8, 16):
        cache = SFAKeyCache(B, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
        cache.append(k, v)
        nbytes = cache.allocated_bytes()
        with skip_nan_checks():
            ref, ref_lse = decode.sfa_decode(q, cache, backend="reference")
        for split, pps in variants:
            decode._SPLIT_D, decode._PROGRAMS_PER_SM = split, pps
            try:
                with skip_nan_checks():
                    got, lse = decode.sfa_decode(q, cache, backend="triton")
                err = (got.float() - ref.float()).abs().max().item()
                lse_err = (lse - ref_lse).abs().max().item()
                if not (err < 1e-2 and lse_err < 1e-3):
                    print(f"FAIL T={T} k={topk} split={split} pps={pps}: max error {err}, lse {lse_err}", flush=True)
                    continue
                ms = timed(f"T={T} k={topk} split_d={split} pps={pps} err={err:.1e}",
                           lambda: decode.sfa_decode_triton(q, cache, scale=D ** -0.5), nbytes, T=T, topk=topk,
                           kernel="sfa", split_d=split, pps=pps, err=err, lse_err=lse_err)
                rows[-1]["x_dense"] = dense_ms / ms
                print(f"    x dense {dense_ms / ms:.3f}", flush=True)
            except Exception as e:
                print("fail", split, pps, repr(e)[:400], flush=True)
        del cache

compiled = []
for cache in decode._sfa_decode_chunk.device_caches.values():
    for kernel in cache[0].values():
        meta = kernel.metadata
        compiled.append(dict(split_d=getattr(meta, "constants", {}).get("SPLIT_D") if hasattr(meta, "constants") else None,
                             n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=meta.shared,
                             num_stages=meta.num_stages, name=str(meta.name)))
        print("compiled:", compiled[-1], flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               rows=rows, compiled=compiled), open(os.path.join(out_dir, "split_probe.json"), "w"), indent=1)
