#!/bin/bash
# Call C (session 25). Found offline (TTGIR of the tree): at 3-4 stages Triton keeps one buffer of every staged load
# (the V tile included), so V is prefetched less than a tile ahead; 5-6 stages give two buffers (28 KB of shared
# memory), 8 give three (42 KB). The tree (index words, per-slot denominators, base-2 softmax with one-instruction
# exponentials, the 16-bit query table -- the float32 table of call B measured 2-6x slower and was dropped --, a
# merge over 4x the programs, programmatic dependent launches):
# 1. swept over stages 4/5/8 and programs per SM, gated; pick_plan.py writes the fastest plan into this copy of the
#    tree (plan.txt), and everything after runs that plan;
# 2. the same without the dependent launches, gated; 3. ncu of one decode step (each kernel's duration; the main
#    kernel's stall reasons, throughputs, occupancy); 4. the CUDA tests; 5. the gated decode rows of `sieve bench
#    sfa` and `sieve bench focus`.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=benchmarks/results/sfa_h200/v9/index_words_probe.py
PROBE_DIMS=128 PROBE_STAGES=4,5,8 PROBE_PROGRAMS=5,6,7,8 timeout 130 python3 $P $OUT sweep > $OUT/probe_sweep_128.txt 2>&1
echo "exit $?" >> $OUT/probe_sweep_128.txt
PROBE_DIMS=64 PROBE_STAGES=4,5,8 PROBE_PROGRAMS=8,10,12 timeout 110 python3 $P $OUT sweep > $OUT/probe_sweep_64.txt 2>&1
echo "exit $?" >> $OUT/probe_sweep_64.txt
python3 benchmarks/results/sfa_h200/v9/pick_plan.py $OUT/index_words_sweep_plan_D128.json $OUT/index_words_sweep_plan_D64.json \
    > $OUT/plan.txt 2>&1; cat $OUT/plan.txt | cut -c1-600; git diff --stat
PROBE_FOCUS=1 PROBE_PLAN=defaults timeout 90 python3 $P $OUT tree > $OUT/probe_tree.txt 2>&1
echo "exit $?" >> $OUT/probe_tree.txt
PROBE_NO_PDL=1 PROBE_PLAN=defaults timeout 60 python3 $P $OUT tree_no_pdl > $OUT/probe_tree_no_pdl.txt 2>&1
echo "exit $?" >> $OUT/probe_tree_no_pdl.txt
grep -h "dense sdpa\|exit" $OUT/probe_*.txt
grep -h '"kernel": "focus"' $OUT/probe_*.txt | cut -c1-200
grep -h '"kernel": "sfa"' $OUT/probe_tree*.txt | cut -c1-300
timeout 90 ncu --clock-control none --kernel-name regex:"sparse_query_table|sfa_decode_chunk|merge" --launch-skip 3 \
    --launch-count 3 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/results/sfa_h200/v9/ncu_one.py > $OUT/ncu_all.txt 2>&1
echo "ncu exit $?" >> $OUT/ncu_all.txt
grep -E "^  [_a-zA-Z].*\(|gpu__time|dram__|exit" $OUT/ncu_all.txt | cut -c1-150
timeout 100 ncu --clock-control none --kernel-name regex:_sfa_decode_chunk --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    python3 benchmarks/results/sfa_h200/v9/ncu_one.py > $OUT/ncu.txt 2>&1
echo "ncu exit $?" >> $OUT/ncu.txt
grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Issue Slots Busy|Issued Ipc|No Eligible|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Mem Busy|Max Bandwidth|exit" $OUT/ncu.txt | head -30
grep -E "issue_stalled" $OUT/ncu.txt | awk '$NF+0 > 0.05' | sort -k3 -g -r | head -12
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/bench_sfa > $OUT/bench_sfa_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_sfa_stdout.txt; tail -n 14 $OUT/bench_sfa_stdout.txt
timeout 90 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/bench_focus > $OUT/bench_focus_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_focus_stdout.txt; tail -n 10 $OUT/bench_focus_stdout.txt
