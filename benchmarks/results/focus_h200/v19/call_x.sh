#!/bin/bash
# v19 call X (session 22): the 64K top-2 work (one scatter pass packs both layouts, the layout's runs in Triton
# kernels, the float16 copies' maxima in one kernel per tensor, the merge's row loads beside their lse). CUDA tests
# of what changed; v18's code (scratch/v18, `git archive 55590a9 sieve_attn`) against v19's, 64K K=8 forward
# side by side twice in alternation; the share profile of both (v19 at 256K too).
export PYTHONUNBUFFERED=1
NEW=$PWD OLD=$PWD/scratch/v18
PYTHONPATH=$NEW timeout 300 python3 -m pytest -q -x tests/ops/test_merge.py tests/ops/test_gather.py \
    tests/ops/test_magnitude.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py \
    tests/ops/test_focus_triton.py tests/test_bench_focus.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
mkdir -p $OUT/ab
for run in 1 2; do
  for code in old new; do
    dir=$NEW; [ $code = old ] && dir=$OLD
    PYTHONPATH=$dir timeout 120 python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8 --top-k 1,2 \
        --baselines cudnn --decode-lengths '' --reps 10 --budget 1.0 --max-call-seconds 6 --skip-nan-checks \
        --out $OUT/ab/$code$run > $OUT/ab/${code}${run}_stdout.txt 2>&1
    echo "bench exit $?" >> $OUT/ab/${code}${run}_stdout.txt; echo "== $code $run"; tail -3 $OUT/ab/${code}${run}_stdout.txt
  done
done
PYTHONPATH=$OLD timeout 90 python3 benchmarks/results/focus_h200/v19/profile_share.py v18 65536 > $OUT/share_stdout.txt 2>&1
PYTHONPATH=$NEW timeout 150 python3 benchmarks/results/focus_h200/v19/profile_share.py v19 65536 262144 >> $OUT/share_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/share_stdout.txt; grep -v Warn $OUT/share_stdout.txt | cut -c1-400
rm -f $OUT/*/*.png $OUT/ab/*/*.png
cd $OUT && tar czf call_x.tgz --remove-files pytest_cuda_stdout.txt ab share_stdout.txt profile_share_*.json && ls -la $OUT
