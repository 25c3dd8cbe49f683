#!/bin/bash
# v10 call B: top-2 at 1M tokens, K=8, auto (which now takes inclusion-exclusion from PAIRS_CALL_FROM tokens per
# group) and the Triton kernels side by side against cuDNN; forward only.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m sieve_attn.cli bench focus --lengths 1M --groups 8 --top-k 2 --backends triton --baselines cudnn \
    --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 20 --skip-nan-checks --out $OUT/bench \
    > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -12 $OUT/bench_stdout.txt
