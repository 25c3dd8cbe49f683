#!/bin/bash
# Call F (session 26): the pool only where chunks hold at least 24 tiles (128K here; 8K and 32K got slower with it
# in call E): the gated decode rows of `sieve bench sfa`, JSON and PNG kept; then the SFA cache and decode tests.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png $OUT/
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
