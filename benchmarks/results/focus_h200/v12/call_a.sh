#!/bin/bash
# v12 call A (to run; built in session 18, not yet measured): the window kernel queued first on a side stream
# (SideStream), the layouts sorted lazily after it, the segment sizes by searchsorted; the memory-efficient masked
# family's backward in float32 for 16-bit inputs (as the CPU family's since 84826c1). CUDA tests; the profile at
# 64K (v11's script); the gated bench of top-1 and top-2 at 64K (forward and forward+backward) and top-2 at 256K.
# Compare with v11 call B (top-2) and v8 call Q (top-1: 64K K=8 5.09x).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -x tests/ops/test_side_stream.py tests/ops/test_gather.py tests/ops/test_merge.py \
 tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
timeout 90 python3 benchmarks/results/focus_h200/v11/profile_top2.py 65536 > $OUT/profile_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/profile_stdout.txt; cat $OUT/profile_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8,16 --top-k 1,2 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -30 $OUT/bench_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 256K --groups 8,16 --top-k 2 --backends sdpa --baselines cudnn \
    --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $OUT/bench_256k \
    > $OUT/bench_256k_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_256k_stdout.txt; tail -8 $OUT/bench_256k_stdout.txt
rm -f $OUT/bench_256k/*.png  # at most 8 files come back
