#!/bin/bash
# Session 38, call C (under 380 s of device time left): `sieve bench focus --backward` at 64K, K = 8, top-1, D = 128,
# whose gradient gate now runs, at 4K, the backend the timed length resolves to; rows are written under $OUT as they
# complete (a cut call keeps them).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 250 python3 -m sieve_attn.cli bench focus --lengths 64K --head-dims 128 --groups 8 --top-k 1 --backward \
    --decode-lengths '' --out $OUT/bench_focus > $OUT/bench_focus.txt 2>&1
echo "bench focus exit $?" >> $OUT/bench_focus.txt; tail -n 6 $OUT/bench_focus.txt
