#!/bin/bash
# v13 call D: the side stream removed (call C: serial was as fast for top-2 and faster for top-1, and the side
# stream's window buffer, allocated after the sorts, could reuse a block the sorts still used: call C's bench hit an
# illegal memory access); every host read still queued before the window kernel. CUDA tests; the tile-plan probe of
# the window and merge kernels; the gated bench at 64K (top-1 and top-2, forward and forward+backward).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/ops/test_gather.py tests/ops/test_merge.py tests/ops/test_focus_sdpa.py \
 tests/ops/test_focus_groups.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
timeout 200 python3 benchmarks/results/focus_h200/v13/probe_window_merge.py > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; cat $OUT/probe_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8,16 --top-k 1,2 --backends sdpa,triton \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -30 $OUT/bench_stdout.txt
rm -f $OUT/*/*.png  # at most 8 files come back
