#!/bin/bash
# Call D (session 28), on the committed tree (ccc3221): the CUDA tests of both decode kernels, the merge and SFA
# generation, then the gated decode rows of `sieve bench sfa`.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png $OUT/ 2>&1
