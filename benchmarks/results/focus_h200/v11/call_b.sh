#!/bin/bash
# v11 call B: call A's tree plus the float16 copies made in the packing pass (gather_rows with a factor and a
# dtype; one max-norm reduction per tensor). CUDA tests of the gather, the merge and the decomposition; the profile
# at 64K; the gated bench of top-2 (--spread combinations) at 32K-256K, both fast backends against cuDNN.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/ops/test_gather.py tests/ops/test_merge.py tests/ops/test_focus_sdpa.py \
 -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
timeout 90 python3 benchmarks/results/focus_h200/v11/profile_top2.py 65536 > $OUT/profile_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/profile_stdout.txt; cat $OUT/profile_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 32K,64K,256K --groups 8,16 --top-k 2 --spread combinations \
    --backends sdpa,triton --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 \
    --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -40 $OUT/bench_stdout.txt
