"""Device probe (v15, written in session 19, not yet run): pass 1 of the Focus decode kernel, the scan of each
chunk's group bit sets, in wider steps (decode._SCAN_N keys) and software-pipelined (decode._SCAN_STAGES), against
the measured kernel (64 keys, no pipeline: SASS identical to v9's in an offline sm_90 compile).

Count first (128K cached tokens, GQA 32/8, one query, B=1; the plan of 6 programs per SM gives 98 chunks of 1344
keys per KV head, two waves of 3 resident programs per SM): a program scans 21 steps of 64 keys, each waiting on a
global load of their bit sets (the offline compile pipelines pass 2's loads, not pass 1's), then attends 3 tiles
(top-1) or 10 (top-2, combinations). From v12 (0.077 ms top-1, 0.125 ms top-2 for two waves): about 1.3 us per scan
step and 3.4 us per attended tile. Prediction: 256-key steps (6 waits) or a pipelined scan take about 25 us per wave
off, 0.077 -> about 0.045 ms (top-1, 3.0x dense) and 0.125 -> about 0.095 ms (top-2, 1.44x).

Each plan's output must equal the measured plan's bit for bit (the list of attended positions does not depend on
the scan), and the measured plan's must be within 1e-2 of the float32 reference. CUDA-graph replays with a cold L2,
against dense SDPA decode, as the bench times them. Writes OUT/decode_scan_probe.json (OUT: the first argument)."""
import json
import os
import sys

import torch

from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus import decode
from sieve_attn.ops.focus.reference import focus_attention_reference, group_bits

dev = torch.device("cuda")
torch.manual_seed(0)
B, HQ, HKV, D, T, K, W = 1, 32, 8, 128, 128 * 1024, 8, 128
q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(B, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
backend = first_working_sdpa(q, k, v, causal=False)
dense_ms = measure(graphed(lambda: sdpa(q, k, v, backend, causal=False)), dev, warmup=3, reps=50, budget_s=1.0).ms
print(f"dense sdpa decode ({backend}) {dense_ms:.4f} ms", flush=True)
rows = [dict(name="dense", backend=backend, ms=dense_ms)]
base = (decode._SCAN_N, decode._SCAN_STAGES, decode._PROGRAMS_PER_SM)
plans = [base, (128, 1, 6), (256, 1, 6), (512, 1, 6), (64, 2, 6), (64, 3, 6), (128, 3, 6), (256, 2, 6), (256, 3, 6),
         (256, 1, 3), (256, 1, 9), (64, 3, 3), (64, 3, 9), base]
cases = [("top1", balanced_groups(T, K, 1)), ("top2_combinations", balanced_groups(T, K, 2)),
         ("top2_adjacent", balanced_groups(T, K, 2, spread="adjacent"))]
for name, ids in cases:
    ids = ids.to(dev)
    bits = group_bits(ids)
    ref, _ = focus_attention_reference(q.float(), k.float(), v.float(), ids, window=W, causal=True, scale=D ** -0.5)
    call = lambda: decode.focus_decode(q, k, v, bits, window=W, scale=D ** -0.5)
    expected = call()[0].clone()
    err = (expected.float() - ref).abs().max().item()
    assert err < 1e-2, f"{name}: the measured plan is off the reference by {err}"
    for scan_n, scan_stages, pps in plans:
        decode._SCAN_N, decode._SCAN_STAGES, decode._PROGRAMS_PER_SM = scan_n, scan_stages, pps
        try:
            same = torch.equal(call()[0], expected)
            ms = measure(graphed(call), dev, warmup=3, reps=50, budget_s=1.0).ms if same else None
            row = dict(name=name, scan_n=scan_n, scan_stages=scan_stages, pps=pps, same_output=same, ms=ms,
                       x_dense=dense_ms / ms if ms else None, reference_err=err)
        except Exception as error:  # a plan Triton cannot build (shared memory, registers)
            row = dict(name=name, scan_n=scan_n, scan_stages=scan_stages, pps=pps, error=repr(error)[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
    decode._SCAN_N, decode._SCAN_STAGES, decode._PROGRAMS_PER_SM = base
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               rows=rows), open(os.path.join(sys.argv[1], "decode_scan_probe.json"), "w"), indent=1)
