"""Device probe (not a library file): the SFA decode kernel (v6: one key per thread, the query table) against the
v4 kernel (HEAD before v6, carried in scratch/old/decode_v4.py) and dense SDPA decode at 128K cached tokens, GQA
32/8, D=128, bf16, CUDA-graph replays with a cold L2. Each variant's output is checked against the PyTorch reference
of sfa_decode in the same run (max abs error against float32 arithmetic; the precision rule, at most twice the error of the reference
run in bf16 against float64, is the test suite's, on small shapes). Writes decode_probe.json to the folder given."""
import importlib.util, json, os, sys
import torch
from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.sfa import decode as new
from sieve_attn.ops.sfa.cache import SFAKeyCache

spec = importlib.util.spec_from_file_location(  # git show 79cc8b2:sieve_attn/ops/sfa/decode.py
    "sieve_attn.ops.sfa.decode_v4", "scratch/old/decode_v4.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
out_dir = sys.argv[1]
dev = torch.device("cuda"); torch.manual_seed(0)
B, HQ, HKV, D = 1, 32, 8, 128
lengths = [int(x) * 1024 for x in (sys.argv[2] if len(sys.argv) > 2 else "128").split(",")]
rows = []

def timed(name, fn, nbytes, **extra):
    ms = measure(graphed(fn), dev, warmup=3, reps=50, budget_s=1.0).ms
    rows.append(dict(name=name, ms=ms, tbps=nbytes / ms / 1e9, **extra))
    print(f"{name:60s} {ms:.4f} ms  {nbytes / ms / 1e9:.2f} TB/s {extra}", flush=True)
    return ms

for T in lengths:
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    backend = first_working_sdpa(q, k, v, causal=False)
    dense_ms = timed(f"T={T} dense sdpa decode ({backend})", lambda: sdpa(q, k, v, backend, causal=False),
                     2 * k.numel() * 2, T=T)
    for topk in (8, 16):
        cache = SFAKeyCache(B, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
        cache.append(k, v)
        nbytes = cache.allocated_bytes()
        with skip_nan_checks():
            ref, _ = new.sfa_decode(q, cache, backend="reference")  # float32 arithmetic on the bf16 inputs
        def check(got):
            err = (got.float() - ref.float()).abs().max().item()
            assert err < 1e-2, f"wrong output: max error {err}"
            return err
        with skip_nan_checks():
            got = old.sfa_decode(q, cache, backend="triton")[0]
        err = check(got)
        timed(f"T={T} k={topk} v4 kernel (HEAD) err={err:.1e}", lambda: old.sfa_decode_triton(q, cache, scale=D ** -0.5),
              nbytes, T=T, topk=topk, kernel="v4", err=err, x_dense=None)
        rows[-1]["x_dense"] = dense_ms / rows[-1]["ms"]
        base = (new._BLOCK_N, new._NUM_WARPS, new._NUM_STAGES, new._PROGRAMS_PER_SM)
        variants = [base] + [tuple(int(x) for x in v.split("/")) for v in os.environ.get("VARIANTS", "").split()]
        for bn, warps, stages, pps in variants:
            new._BLOCK_N, new._NUM_WARPS, new._NUM_STAGES, new._PROGRAMS_PER_SM = bn, warps, stages, pps
            try:
                with skip_nan_checks():
                    got = new.sfa_decode(q, cache, backend="triton")[0]
                err = check(got)
                ms = timed(f"T={T} k={topk} v6 BLOCK_N={bn} warps={warps} stages={stages} pps={pps} err={err:.1e}",
                           lambda: new.sfa_decode_triton(q, cache, scale=D ** -0.5), nbytes, T=T, topk=topk,
                           kernel="v6", block_n=bn, warps=warps, stages=stages, pps=pps, err=err)
                rows[-1]["x_dense"] = dense_ms / ms
                print(f"    x dense {dense_ms / ms:.3f}", flush=True)
            except Exception as e:
                print("fail", bn, warps, stages, pps, repr(e)[:300], flush=True)
        new._BLOCK_N, new._NUM_WARPS, new._NUM_STAGES, new._PROGRAMS_PER_SM = base
        # v6 as calls A-D measured it: each value loaded by itself (2 bytes, left unstaged by the pipeline)
        words = new._value_words
        new._value_words = lambda values: values
        with skip_nan_checks():
            err = check(new.sfa_decode(q, cache, backend="triton")[0])
        ms = timed(f"T={T} k={topk} v6 plain value loads, default plan err={err:.1e}",
                   lambda: new.sfa_decode_triton(q, cache, scale=D ** -0.5), nbytes, T=T, topk=topk,
                   kernel="v6-plain-values", err=err)
        rows[-1]["x_dense"] = dense_ms / ms
        print(f"    x dense {dense_ms / ms:.3f}", flush=True)
        new._value_words = words
        del cache
best = min((r for r in rows if r.get("kernel") == "v6" and r["topk"] == 16), key=lambda r: r["ms"])
json.dump([best["block_n"], best["warps"], best["stages"], best["pps"]], open(os.path.join(out_dir, "best.json"), "w"))
print("best k=16:", best["name"], best["ms"], "x dense", best["x_dense"])
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, rows=rows), open(os.path.join(out_dir, "decode_probe.json"), "w"),
          indent=1)
