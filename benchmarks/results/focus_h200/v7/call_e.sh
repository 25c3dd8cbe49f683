#!/bin/bash
# Call E: final CUDA tests of this session's Focus changes, and the gated bench under auto (sdpa from 4K tokens
# per group) at 16K and 64K.
mkdir -p /tmp/r; R=/tmp/r
export PYTHONPATH=$PWD
timeout 280 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_gather.py tests/ops/test_focus_sdpa.py \
    tests/ops/test_focus_triton.py tests/ops/test_focus_groups.py tests/ops/test_focus_decode.py tests/ops/test_sfa_cache.py \
    tests/ops/test_focus_flex.py > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/pytest_cuda.txt | tail -20
timeout 100 python3 -m sieve_attn.cli bench focus --lengths 16K,64K --groups 8,16 --top-k 1 --backward \
    --max-backward-length 64K --decode-lengths '' --baselines cudnn,prototype --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $R/bench_auto > $R/bench_auto.txt 2>&1
tail -10 $R/bench_auto.txt
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
