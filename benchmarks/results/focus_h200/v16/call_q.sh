#!/bin/bash
# v16 call Q: auto's rule at 4K tokens per group (call I: at 64K, K=16, forward, the sdpa backend 8.20x against the
# Triton kernels' 6.94-6.99x, where v14's sweep had 4.90-5.68x against 6.92-6.94x). Both backends side by side, two
# runs, forward, 64K and 128K tokens with 16 and 32 groups (4K and 2K per group at 64K; 8K and 4K at 128K).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for run in 1 2; do
  python3 -m sieve_attn.cli bench focus --lengths 64K,128K --groups 16,32 --top-k 1 --backends sdpa,triton \
      --baselines cudnn --decode-lengths '' --reps 10 --budget 0.5 --max-call-seconds 6 --skip-nan-checks \
      --out $OUT/run_$run > $OUT/run_${run}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/run_${run}_stdout.txt; grep "| forward" $OUT/run_${run}_stdout.txt
done
rm -f $OUT/*/*.png
