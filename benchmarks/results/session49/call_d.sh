#!/bin/bash
# Session 49, call D (any H100 or H200): SFA decode planned for the programs an SM holds of its compiled kernel
# (split_k.programs_per_sm). Call C (an H100) found the step at topk 20 and 24 a third slower than at 16 for 4-8% more
# bytes; compiled for sm_90 its shared memory fits 8 programs an SM at topk 16 but 7 at 20 and 6 at 24, where the
# plan put 8. Here: the gated bench rows of call C at 128K again (now planned for what
# an SM holds) and the programs held per configuration: all the session's remaining device time allowed (the GPU
# tests of the decode steps, SFA's and Focus's, which plan the same way, ran on the CPU's interpreter only).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 90 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 16,20,24 \
    --decode-lengths 128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_k > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_k/bench_sfa.json $OUT/ 2>/dev/null
python3 - <<'PY' | tee $OUT/held.txt
import torch
from sieve_attn.ops import split_k
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.decode import sfa_decode, _programs_per_sm
for D in (64, 128):
    for k in (16, 20, 24):
        cache = SFAKeyCache(1, 8, D, topk=k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, 8, 4096, D, device="cuda", dtype=torch.bfloat16)
        cache.append(x, x)
        split_k._HELD.clear()
        sfa_decode(torch.randn(1, 32, 1, D, device="cuda", dtype=torch.bfloat16), cache, backend="triton")
        print(f"D={D} topk={k}: wanted {_programs_per_sm(D)}, an SM holds {list(split_k._HELD.values())}")
PY
