#!/bin/bash
# v19 call Y (session 22): after call X, the scatter packing and the merge's reordered loads are reverted (no gain);
# the maxima kernel rewritten (no divisions per row). CUDA tests; the maxima kernel's plans probed; v18's code
# against v19's at 64K K=8 forward, twice in alternation; the share profile of v19 at 64K.
export PYTHONUNBUFFERED=1
NEW=$PWD OLD=$PWD/scratch/v18
PYTHONPATH=$NEW timeout 300 python3 -m pytest -q tests/ops/test_merge.py tests/ops/test_gather.py \
    tests/ops/test_magnitude.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py \
    tests/ops/test_focus_triton.py tests/ops/test_focus_flex.py tests/test_bench_focus.py -p no:cacheprovider \
    > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
PYTHONPATH=$NEW timeout 150 python3 benchmarks/results/focus_h200/v19/probe_largest.py > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; cat $OUT/probe_stdout.txt
mkdir -p $OUT/ab
for run in 1 2; do
  for code in old new; do
    dir=$NEW; [ $code = old ] && dir=$OLD
    PYTHONPATH=$dir timeout 120 python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8 --top-k 1,2 \
        --baselines cudnn --decode-lengths '' --reps 10 --budget 1.0 --max-call-seconds 6 --skip-nan-checks \
        --out $OUT/ab/$code$run > $OUT/ab/${code}${run}_stdout.txt 2>&1
    echo "bench exit $?" >> $OUT/ab/${code}${run}_stdout.txt; echo "== $code $run"; tail -4 $OUT/ab/${code}${run}_stdout.txt | head -2
  done
done
PYTHONPATH=$NEW timeout 90 python3 benchmarks/results/focus_h200/v19/profile_share.py v19 65536 > $OUT/share_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/share_stdout.txt; grep -v Warn $OUT/share_stdout.txt | cut -c1-330
rm -f $OUT/ab/*/*.png
cd $OUT && tar czf call_y.tgz --remove-files pytest_cuda_stdout.txt probe_stdout.txt probe_largest.json ab \
    share_stdout.txt profile_share_*.json && ls -la $OUT
