#!/bin/bash
# Call Q (nvidia-h200): CUDA tests of the sdpa path with the window partial in q's dtype, then the top-1 bench.
mkdir -p /tmp/r; R=/tmp/r; rm -rf /tmp/r/*
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_focus_sdpa.py tests/ops/test_merge.py \
    > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/pytest_cuda.txt | tail -8
timeout 100 python3 -m sieve_attn.cli bench focus --backend sdpa --lengths 64K,256K,1M --groups 8,16 --top-k 1 \
    --decode-lengths '' --baselines cudnn,prototype --reps 5 --budget 0.5 --max-call-seconds 6 --skip-nan-checks \
    --out $R/bench_bf16_partial > $R/bench_bf16_partial.txt 2>&1
tail -9 $R/bench_bf16_partial.txt
tar czf $OUT/results.tgz -C $R .
