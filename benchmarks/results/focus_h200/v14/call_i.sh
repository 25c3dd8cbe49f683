#!/bin/bash
# v14 call I (to run; written in session 19, when no device was lent after call H): SDPA_FROM in auto, the review's
# fixes to the plan (the sorts' temporaries dropped after their reads, float64 kept through the one-membership
# merge, tile sizes checked), int32 sort keys. CUDA tests; auto's rows where its choice changed (forward: 32K K=8
# and 64K K=16 now take the Triton kernels; with gradients the sdpa backend), with both fast backends beside it;
# the share profile again (the sorts' time, against call H's); 8K-16K top-1 as CUDA graphs (call G: 8K 0.92x).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/ops/test_merge.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py \
 tests/ops/test_focus_triton.py tests/test_bench_focus.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 32K,64K --groups 8,16 --top-k 1 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 10 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/auto > $OUT/auto_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/auto_stdout.txt; tail -26 $OUT/auto_stdout.txt
timeout 150 python3 benchmarks/results/focus_h200/v14/profile_share.py 65536 262144 > $OUT/share_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/share_stdout.txt; cat $OUT/share_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 8K,16K --groups 8,16 --top-k 1 --backend triton --baselines cudnn \
    --decode-lengths '' --reps 10 --budget 0.5 --max-call-seconds 6 --skip-nan-checks --cuda-graphs \
    --out $OUT/graphs > $OUT/graphs_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/graphs_stdout.txt; tail -6 $OUT/graphs_stdout.txt
rm -f $OUT/*/*.png  # at most 8 files come back
