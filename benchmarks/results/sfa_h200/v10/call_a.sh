#!/bin/bash
# Call A (session 26), on f9a3da8 (the timeline failed on a typo, torch.sum(out=); fixed and rerun at once on the
# warm machine: call_a/timeline_stdout.txt and timeline.json are that rerun): 1. where a decode step's time goes (timeline.py: the profiler's kernel durations
# and gaps in graph replays; write vs read L2 flush); 2. the CUDA tests of both decode kernels, the merge and SFA
# generation (Focus's log2 e moved into its caller's scale after session 25's last call); 3. the gated decode rows of
# `sieve bench sfa` and `sieve bench focus`, their JSON and PNG kept (at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 100 python3 benchmarks/results/sfa_h200/v10/timeline.py $OUT > $OUT/timeline_stdout.txt 2>&1
echo "exit $?" >> $OUT/timeline_stdout.txt; tail -c 3500 $OUT/timeline_stdout.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 3 $OUT/pytest_cuda.txt
timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_sfa > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt
timeout 90 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus >> $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep -v "^ *$" $OUT/bench_stdout.txt | tail -n 30
cp /tmp/bench_sfa/*.json /tmp/bench_sfa/*.png /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
ls $OUT
