#!/bin/bash
# v13 call C: every host read queued before the window kernel (the sorts and, for inclusion-exclusion, the largest
# magnitudes), the window kernel then on the side stream; v12 (call A) sorted after the window launch and lost
# top-1 64K K=8 from v8's 5.09x to 4.59-4.76x. CUDA tests; the timeline of one forward (side stream and serial);
# the gated bench at 64K (top-1 and top-2, forward and forward+backward) and 256K (K=8).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -x tests/ops/test_side_stream.py tests/ops/test_gather.py tests/ops/test_merge.py \
 tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
timeout 120 python3 benchmarks/results/focus_h200/v13/profile_timeline.py 65536 > $OUT/timeline_stdout.txt 2>&1
echo "timeline exit $?" >> $OUT/timeline_stdout.txt; cat $OUT/timeline_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8,16 --top-k 1,2 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -30 $OUT/bench_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 256K --groups 8 --top-k 1,2 --backends sdpa --baselines cudnn \
    --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $OUT/bench_256k \
    > $OUT/bench_256k_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_256k_stdout.txt; tail -8 $OUT/bench_256k_stdout.txt
rm -f $OUT/*/*.png  # at most 8 files come back
