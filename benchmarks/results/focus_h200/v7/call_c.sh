#!/bin/bash
# Call C: the top-1 layout without a host sync and FocusGroups validation with one sync: CUDA tests, then the gated
# bench under auto (sdpa for long groups), top-2 rows and decode with 2 stages.
mkdir -p /tmp/r; R=/tmp/r
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_focus_triton.py \
    tests/ops/test_focus_groups.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_decode.py > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/pytest_cuda.txt | tail -20
timeout 200 python3 -m sieve_attn.cli bench focus --lengths 8K,64K,256K,1M --groups 8,16 --top-k 1 --backward \
    --max-backward-length 64K --decode-lengths '' --baselines cudnn,prototype --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $R/bench_top1 > $R/bench_top1.txt 2>&1
tail -22 $R/bench_top1.txt
timeout 120 python3 -m sieve_attn.cli bench focus --lengths 64K,256K --groups 8 --top-k 2 --backward \
    --max-backward-length 64K --decode-lengths 32K,128K --baselines cudnn --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --cuda-graphs --out $R/bench_top2 > $R/bench_top2.txt 2>&1
tail -10 $R/bench_top2.txt
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
