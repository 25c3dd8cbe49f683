#!/bin/bash
# v14 call I (the committed code): SDPA_FROM in auto, the review's fixes to the plan (the sorts' temporaries dropped
# after their reads, float64 kept through the one-membership merge, tile sizes checked). CUDA tests; then auto's
# rows where its choice changed (forward: 32K K=8 and 64K K=16 now take the Triton kernels; with gradients the
# sdpa backend), with both fast backends beside it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/ops/test_merge.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py \
 tests/ops/test_focus_triton.py tests/test_bench_focus.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 32K,64K --groups 8,16 --top-k 1 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 10 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/auto > $OUT/auto_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/auto_stdout.txt; tail -26 $OUT/auto_stdout.txt
rm -f $OUT/*/*.png  # at most 8 files come back
