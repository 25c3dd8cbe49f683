#!/bin/bash
# Call B (session 30), Focus decode v23: pass 1 scans the distinct positions of a program's rows (one at Tq = 1)
# instead of its BLOCK_M rows. The CUDA tests of the Focus decode kernel, then the probe against v22 (the committed
# kernel, copied beside as _decode_v22) and call A's prefetch-only kernel (_decode_v23a), with the prefetch depth,
# the scan step and the programs per SM varied, at 128K and 32K; then the gated decode rows of `sieve bench focus`.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/*decode*.py sieve_attn/ops/triton_common.py > $OUT/digests.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_decode.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
timeout 320 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths 128K,32K --rounds 5 --out $OUT \
    --variants _decode_v22,_decode_v23a:_PREFETCH_KEYS=64,decode,decode:_PREFETCH_KEYS=0,decode:_PREFETCH_KEYS=128,decode:_SCAN_N=1024,decode:_PROGRAMS_PER_SM=3,decode:_PROGRAMS_PER_SM=9 \
    > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep '"ms"\|FAIL\|exit' $OUT/probe_stdout.txt | sed 's/"rounds": \[[^]]*\], //'
timeout 130 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
