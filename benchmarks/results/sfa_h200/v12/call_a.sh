#!/bin/bash
# Call A (session 28): each decode program sparsifies its own query rows (no query-table launch) and the pool
# counters reset themselves. The probe times the tree's step beside f66370d's (its decode.py carried as
# scratch/_decode_f66370d.py) and two prefetch depths, 128K and 64K; then the SFA CUDA tests and the gated bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cp scratch/_decode_f66370d.py sieve_attn/ops/sfa/
V=decode,_decode_f66370d,decode:_PREFETCH_TILES=0,decode:_PREFETCH_TILES=4
timeout 240 python3 benchmarks/decode_probe.py --out $OUT --variants $V --lengths 128K,64K > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep '"ms"\|FAIL\|exit\|Error' $OUT/probe_stdout.txt | cut -c1-160
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/integrations/test_sfa_cache.py \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png $OUT/ 2>&1
