#!/bin/bash
# v13 call E (the committed code): the window set's query tiles of 64 rows (Tiling.window_m) and the merge kernel's
# 16 rows / 2 warps, the plans call D's probe measured fastest. CUDA tests (sdpa, Triton, merge, gather, groups); the
# gated bench at 64K (forward and forward+backward), 256K and 1M.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -x tests/ops/test_gather.py tests/ops/test_merge.py tests/ops/test_focus_sdpa.py \
 tests/ops/test_focus_groups.py tests/ops/test_focus_triton.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8,16 --top-k 1,2 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -30 $OUT/bench_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 256K,1M --groups 8,16 --top-k 1,2 --backends sdpa --baselines cudnn \
    --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 20 --skip-nan-checks --out $OUT/bench_long \
    > $OUT/bench_long_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_long_stdout.txt; tail -20 $OUT/bench_long_stdout.txt
rm -f $OUT/*/*.png  # at most 8 files come back
