#!/bin/bash
# Session 49, call D (any H100 or H200; not run in session 49: no device came back): SFA decode planned for the
# programs an SM holds of its compiled kernel (split_k.programs_per_sm, 6bfe7f0). Call C (an H100) found the step at
# topk 20 and 24 a third slower than at 16 for 4-8% more bytes; compiled for sm_90 its shared memory fits 8 programs
# an SM at topk 16 but 7 at 20 and 6 at 24, where the plan put 8. Here, in about 5 min: the gated bench rows of call C
# at 32K and 128K again (now planned for what an SM holds), the programs held per configuration, a probe of fewer
# pipeline stages at topk 20 and 24 (a smaller kernel, so more programs an SM), then the GPU tests of both decode
# steps (Focus decode plans the same way) and the plan.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 16,20,24 \
    --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_k > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_k/bench_sfa.json /tmp/bench_k/*.png $OUT/ 2>/dev/null
python3 - <<'PY' | tee $OUT/held.txt
import torch
from sieve_attn.ops import split_k
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.decode import sfa_decode, _programs_per_sm
for D in (64, 128):
    for k in (8, 16, 20, 24):
        cache = SFAKeyCache(1, 8, D, topk=k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, 8, 4096, D, device="cuda", dtype=torch.bfloat16)
        cache.append(x, x)
        split_k._HELD.clear()
        sfa_decode(torch.randn(1, 32, 1, D, device="cuda", dtype=torch.bfloat16), cache, backend="triton")
        print(f"D={D} topk={k}: wanted {_programs_per_sm(D)}, an SM holds {list(split_k._HELD.values())}")
PY
timeout 100 python3 benchmarks/decode_probe.py --kernel sfa --topk 20,24 --lengths 128K --rounds 5 \
    --variants 'decode,decode:_NUM_STAGES=4,decode:_NUM_STAGES=3' --out $OUT/probe > $OUT/probe.txt 2>&1
echo "probe exit $?" >> $OUT/probe.txt
grep -o '"variant": "[^"]*", "T": [0-9]*, "topk": [0-9]*, "D": [0-9]*, "rounds": \[[^]]*\], "ms": [0-9.]*, "x_dense": [0-9.]*' $OUT/probe.txt | sed 's/"rounds": \[[^]]*\], //'
timeout 120 python3 -m pytest tests/ops/test_split_k.py tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    -q -x -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "tests exit $?" >> $OUT/tests.txt; tail -3 $OUT/tests.txt
