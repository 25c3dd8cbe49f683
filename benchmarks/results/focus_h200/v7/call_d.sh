#!/bin/bash
# Call D: sdpa packing by the Triton gather kernel. CUDA tests, then sdpa vs triton, top-1, 16K-1M.
mkdir -p /tmp/r; R=/tmp/r
export PYTHONPATH=$PWD
timeout 130 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_gather.py tests/ops/test_focus_sdpa.py \
    tests/ops/test_focus_flex.py > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/pytest_cuda.txt | tail -20
timeout 300 python3 -m sieve_attn.cli bench focus --backend triton --backends sdpa --lengths 16K,64K,256K,1M \
    --groups 8,16 --top-k 1 --backward --max-backward-length 256K --decode-lengths '' --baselines cudnn,prototype \
    --reps 5 --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $R/bench_gather > $R/bench_gather.txt 2>&1
tail -30 $R/bench_gather.txt
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
