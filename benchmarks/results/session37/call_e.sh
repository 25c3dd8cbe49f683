#!/bin/bash
# Session 37, call E (under 300 s of device time left): on an H200 only, the gated decode rows of `sieve bench sfa`
# at 128K, D = 128, k = 8 and 16, written straight to $OUT; any other card stops at once.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
    --reps 10 --cuda-graphs --skip-nan-checks --out $OUT/h200_bench > $OUT/h200_bench.txt 2>&1
echo "bench exit $?" >> $OUT/h200_bench.txt; grep "^| decode\|exit" $OUT/h200_bench.txt
