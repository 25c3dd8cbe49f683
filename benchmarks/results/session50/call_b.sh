#!/bin/bash
# Session 50, call B (at once after call A, on the same warm machine): the same gated bench rows at D = 64 (plan 10
# an SM; the kernel holds 11 / 9 / 8 at topk 16 / 20 / 24), a probe of 4 pipeline stages at topk 20 and 24 (compiled
# for sm_90 with Triton 3.6: 15.5 / 16.9 KiB of shared memory against 30.7 / 33.6 with 5, so 8 programs fit again;
# 4 stages were 5-15% slower than 5 at topk 16, v9), then the GPU tests of both decode steps and the plan.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 240 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64 --topk 16,20,24 \
    --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_k64 > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_k64/bench_sfa.json /tmp/bench_k64/*.png $OUT/ 2>/dev/null
timeout 200 python3 benchmarks/decode_probe.py --kernel sfa --topk 20,24 --lengths 128K --rounds 5 \
    --variants 'decode,decode:_NUM_STAGES=4' --out $OUT/probe > $OUT/probe.txt 2>&1
echo "probe exit $?" >> $OUT/probe.txt
grep -o '"variant": "[^"]*", "T": [0-9]*, "topk": [0-9]*, "D": [0-9]*, "rounds": \[[^]]*\], "ms": [0-9.]*, "x_dense": [0-9.]*' $OUT/probe.txt | sed 's/"rounds": \[[^]]*\], //'
timeout 150 python3 -m pytest tests/ops/test_split_k.py tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    -q -x -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "tests exit $?" >> $OUT/tests.txt; tail -3 $OUT/tests.txt
