#!/bin/bash
# Call A (session 27), on e7287a0 (the pool's review fixes and tests): 1. the CUDA tests of both decode kernels, the
# merge and SFA generation on the final tree (session 26's call F ran out of time in them); 2. step_probe.py: merge
# width, unit size and the pool at 64K, side by side; 3. the gated decode rows of `sieve bench sfa` on this code.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=benchmarks/results/sfa_h200/v11
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 3 $OUT/pytest_cuda.txt
timeout 150 python3 $P/step_probe.py $OUT base,0.1:4:5:8:256:32:24,0.1:4:5:8:256:16:24,0.1:4:5:8:128:32:24,0.1:3:5:8:64:32:24,0.0:4:5:8:64:32:24 > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt
PROBE_LENGTHS=65536 timeout 90 python3 $P/step_probe.py $OUT base,0.1:4:5:8:64:32:0,0.1:4:5:8:256:32:24 >> $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep '"ms"\|FAIL\|exit\|Error' $OUT/probe_stdout.txt | cut -c1-160
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png $OUT/ 2>&1
ls $OUT
