#!/bin/bash
# Call B (session 27), on 3641a70 (the merge in one step of 256 chunks): the gated decode rows of `sieve bench sfa`
# and `sieve bench focus` (whose merge is the same), the probe's base plan beside them in the same call, and the
# CUDA tests of both decode kernels, the merge and SFA generation.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=benchmarks/results/sfa_h200/v11
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt
timeout 90 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus >> $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
PROBE_ROUNDS=3 timeout 60 python3 $P/step_probe.py $OUT base > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep '"ms"\|FAIL\|exit' $OUT/probe_stdout.txt | cut -c1-150
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
ls $OUT
