#!/bin/bash
# v11 call A: the merge of every multi-membership forward in one Triton kernel (merge_indexed with m part rows and a
# subtracted one), the layouts sorted with one host read each. CUDA tests of the decomposition, the merge and the
# Triton backend; the profile of top-2 at 8K and 64K; the gated bench of top-2 with the new default groups
# (--spread combinations) at 64K and 256K, both fast backends side by side against cuDNN.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 220 python3 -m pytest -q -x tests/ops/test_focus_sdpa.py tests/ops/test_merge.py tests/ops/test_focus_triton.py \
 -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
timeout 120 python3 benchmarks/results/focus_h200/v11/profile_top2.py > $OUT/profile_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/profile_stdout.txt; cat $OUT/profile_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 64K,256K --groups 8,16 --top-k 2 --spread combinations \
    --backends sdpa,triton --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 \
    --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -30 $OUT/bench_stdout.txt
