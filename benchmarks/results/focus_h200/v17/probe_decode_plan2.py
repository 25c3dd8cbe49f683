"""Device probe (v17, written in session 20; ran in call R, session 21, at commit 45cc71f, a record now: it sets
decode._NUM_STAGES, which v18 replaced by decode._num_stages): the decode plans v16 left untimed.
- D=64, 128K cached tokens: 128-key tiles (the committed plan) with 3 pipeline stages or 4-5 programs per SM,
  each of which helped 64-key tiles there (v16: top-1 0.047 -> 0.041 and 0.044 ms).
- D=64, 8K and 32K: 128- against 64-key tiles. At 8K a chunk is 128 keys, one mostly masked 128-key tile (v16 call
  O: 0.019-0.020 ms, against 0.017-0.019 for call M's 64-key tiles with the older scan, not side by side).
- D=128, 128K: 3 stages and 4-5 programs per SM with the 512-key scan.

As v16's probe: each plan checked against the float32 reference (within twice the committed plan's error), CUDA
graph replays with a cold L2, against dense SDPA decode; GQA 32/8, B=1, K=8, window 128, top-1 and both top-2
spreads. Writes OUT/decode_plan2.json."""
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
HQ, HKV, K, W = 32, 8, 8, 128
committed = (decode._block_n, decode._NUM_STAGES, decode._PROGRAMS_PER_SM)
rows = []


def probe(head_dim, length, plans):
    torch.manual_seed(0)
    q = torch.randn(1, HQ, 1, head_dim, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, HKV, length, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
    backend = first_working_sdpa(q, k, v, causal=False)
    dense_ms = measure(graphed(lambda: sdpa(q, k, v, backend, causal=False)), dev, warmup=3, reps=50,
                       budget_s=1.0).ms
    print(f"D={head_dim} T={length}: dense sdpa decode ({backend}) {dense_ms:.4f} ms", flush=True)
    rows.append(dict(name="dense", D=head_dim, T=length, backend=backend, ms=dense_ms))
    for name, spread, top_k in (("top1", "combinations", 1), ("top2_combinations", "combinations", 2),
                                ("top2_adjacent", "adjacent", 2)):
        ids = balanced_groups(length, K, top_k, spread=spread).to(dev)
        bits = group_bits(ids)
        ref, _ = focus_attention_reference(q.float(), k.float(), v.float(), ids, window=W, causal=True,
                                           scale=head_dim ** -0.5)
        call = lambda: decode.focus_decode(q, k, v, bits, window=W, scale=head_dim ** -0.5)
        base_err = (call()[0].float() - ref).abs().max().item()
        assert base_err < 1e-2, f"{name}: the committed plan is off the reference by {base_err}"
        for block_n, stages, per_sm in plans:
            decode._block_n = lambda dim, block_n=block_n: block_n
            decode._NUM_STAGES, decode._PROGRAMS_PER_SM = stages, per_sm
            row = dict(name=name, D=head_dim, T=length, block_n=block_n, num_stages=stages, programs_per_sm=per_sm)
            try:
                err = (call()[0].float() - ref).abs().max().item()
                ok = err <= max(2 * base_err, 1e-6) and err < 1e-2
                ms = measure(graphed(call), dev, warmup=3, reps=50, budget_s=1.0).ms if ok else None
                row.update(reference_err=err, ok=ok, ms=ms, x_dense=dense_ms / ms if ms else None)
            except Exception as error:  # a plan Triton cannot build (shared memory, registers)
                row.update(error=repr(error)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
        decode._block_n, decode._NUM_STAGES, decode._PROGRAMS_PER_SM = committed


stages, per_sm = committed[1:]
for length in (8192, 32768):
    probe(64, length, [(128, stages, per_sm), (64, stages, per_sm)])
probe(64, 131072, [(128, stages, per_sm), (128, 3, per_sm), (128, 2, 4), (128, 3, 4), (128, 2, 5), (64, 3, 4)])
probe(128, 131072, [(64, stages, per_sm), (64, 3, per_sm), (64, 2, 4), (64, 3, 4), (64, 2, 5)])
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               committed=dict(block_n_d64=committed[0](64), block_n_d128=committed[0](128), num_stages=stages,
                              programs_per_sm=per_sm), rows=rows),
          open(os.path.join(sys.argv[1], "decode_plan2.json"), "w"), indent=1)
