#!/bin/bash
# Session 50, call A (any H100 or H200, ~6 min): the first GPU run of the decode steps' occupancy query
# (split_k.programs_per_sm, 6bfe7f0: Triton's warmup, the compiled kernel's shared memory and registers, torch's
# device properties), then SFA decode planned by it. Session 49's call C (an H100) found the step at topk 20 and 24 a
# third slower than at 16 for 4-8% more bytes; compiled for sm_90 the kernel fits 8 programs an SM at topk 16 but 7
# at 20 and 6 at 24, where the plan put 8. First the programs held per configuration (if the query fails on the GPU,
# this says so within a minute), then the gated bench rows of call C at D = 128, 32K and 128K. Cold compiles take
# 10-40 s a kernel (more at larger topk), hence the timeouts. Call B follows at once (D = 64, stages, tests).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 240 python3 - <<'PY' 2>&1 | tee $OUT/held.txt
import time
import torch
from sieve_attn.ops import split_k
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.decode import sfa_decode, _programs_per_sm
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: shared/SM {p.shared_memory_per_multiprocessor}, regs/SM {p.regs_per_multiprocessor}, "
      f"threads/SM {p.max_threads_per_multi_processor}, SMs {p.multi_processor_count}")
for D in (128, 64):
    for k in (16, 20, 24):
        start = time.time()
        cache = SFAKeyCache(1, 8, D, topk=k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, 8, 4096, D, device="cuda", dtype=torch.bfloat16)
        cache.append(x, x)
        split_k._HELD.clear()
        sfa_decode(torch.randn(1, 32, 1, D, device="cuda", dtype=torch.bfloat16), cache, backend="triton")
        torch.cuda.synchronize()
        print(f"D={D} topk={k}: wanted {_programs_per_sm(D)}, an SM holds {list(split_k._HELD.values())} "
              f"({time.time() - start:.0f} s with the compile)", flush=True)
PY
timeout 300 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 16,20,24 \
    --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_k > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_k/bench_sfa.json /tmp/bench_k/*.png $OUT/ 2>/dev/null
