#!/bin/bash
# Call E (session 26), the tree with the SFA decode pool (10% of the tiles, 4-tile units, 5 stages, 8 programs per
# SM at D=128, 10 at D=64): 1. the CUDA tests of the SFA cache and decode, Focus decode, the merge and SFA
# generation; 2. bench_repeat.py: the bench's own decode rows three times in one process (is the bench's figure a
# first-run figure?); 3. the gated decode rows of `sieve bench sfa` and `sieve bench focus`, JSON and PNG kept.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=benchmarks/results/sfa_h200/v10
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 3 $OUT/pytest_cuda.txt
timeout 150 python3 $D/bench_repeat.py $OUT > $OUT/bench_repeat_stdout.txt 2>&1
echo "exit $?" >> $OUT/bench_repeat_stdout.txt; grep "repeat\|exit" $OUT/bench_repeat_stdout.txt | cut -c1-200
timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt
timeout 90 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus >> $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
rm -f $OUT/bench_repeat_stdout.txt; ls $OUT
