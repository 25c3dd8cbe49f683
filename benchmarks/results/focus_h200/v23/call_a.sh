#!/bin/bash
# Call A (session 30), Focus decode v23: pass 1 has L2 prefetch the K and V rows of the first _PREFETCH_KEYS listed
# keys of each program. The CUDA tests of both decode kernels, then the probe of the prefetch depth (0 = v22's
# kernel) at 128K and 32K, then the gated decode rows of `sieve bench focus` with the default depth.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py sieve_attn/ops/sfa/decode.py sieve_attn/ops/triton_common.py > $OUT/digests.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_decode.py tests/ops/test_sfa_cache.py \
    tests/ops/test_merge.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
timeout 230 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths 128K,32K --rounds 5 --out $OUT \
    --variants decode:_PREFETCH_KEYS=0,decode:_PREFETCH_KEYS=64,decode,decode:_PREFETCH_KEYS=256 \
    > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep '"ms"\|FAIL\|exit' $OUT/probe_stdout.txt | sed 's/"rounds": \[[^]]*\], //'
timeout 130 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
