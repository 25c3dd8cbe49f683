#!/bin/bash
# v10 call A: top-2 by inclusion-exclusion (two batched cuDNN calls in float16, the pairs counted twice subtracted
# in the merge; the Triton kernels' backward). CUDA tests of the decomposition, the merge and the dispatch, then the
# gated bench of top-2 with both fast backends side by side against cuDNN.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -x tests/ops/test_focus_sdpa.py tests/ops/test_merge.py tests/ops/test_focus_triton.py \
 -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 8K,16K,64K,256K --groups 8,16 --top-k 2 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -40 $OUT/bench_stdout.txt
