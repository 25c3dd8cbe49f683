#!/bin/bash
# Session 50, call D (named nvidia-h200, after calls A-C on an H100): the gated `sieve bench sfa` decode rows of calls
# A and B on an H200 (topk 16 / 20 / 24, D = 128 and 64, 32K and 128K, GQA 32/8, CUDA graphs), with the step planned
# for the programs an SM holds. Exits on a card other than an H200.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt | grep -q H200 || { echo "not an H200"; exit 3; }
timeout 420 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 16,20,24 \
    --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_h200 > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_h200/bench_sfa.json /tmp/bench_h200/*.png $OUT/ 2>/dev/null
