#!/bin/bash
# v16 call M: the decode plan re-swept with v15's scan (probe_decode_plan.py); D=64 decode as CUDA graphs (call L
# timed it with plain launches only); where a plain-launch 8K top-1 forward spends its host time (host_profile.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 benchmarks/results/focus_h200/v16/host_profile.py $OUT > $OUT/host_stdout.txt 2>&1
echo "host profile exit $?" >> $OUT/host_stdout.txt; head -4 $OUT/host_stdout.txt; tail -2 $OUT/host_stdout.txt
timeout 300 python3 benchmarks/results/focus_h200/v16/probe_decode_plan.py $OUT > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; cat $OUT/probe_stdout.txt
python3 -m sieve_attn.cli bench focus --head-dims 64 --lengths '' --groups 8 --top-k 1,2 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_d64 \
    > $OUT/decode_d64_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/decode_d64_stdout.txt; tail -8 $OUT/decode_d64_stdout.txt
rm -f $OUT/*/*.png
