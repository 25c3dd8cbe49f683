#!/bin/bash
# Call F (session 30), on commit dca3788: the last knobs of Focus decode v23 probed side by side at 64K and 128K,
# D = 128 (the scan's step and stages, the prefetch depth, 8 warps).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py sieve_attn/ops/split_k.py > $OUT/digests.txt
timeout 250 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths 64K,128K --rounds 5 --out $OUT \
    --variants "decode,decode:_SCAN_N=256,decode:_SCAN_STAGES=2,decode:_SCAN_STAGES=4,decode:_PREFETCH_KEYS=32,decode:_PREFETCH_KEYS=96,decode:_NUM_WARPS=8" \
    > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep 'FAIL\|exit' $OUT/probe_stdout.txt
