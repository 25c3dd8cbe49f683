#!/bin/bash
# v18 call W (session 21): 64K K=8 forward, top-1 and top-2, backend auto, three gated runs in a row on one machine:
# how much of call V's 1.46x (top-2) is cuDNN's run-to-run spread. The JSON now records the sources' digest.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for run in 1 2 3; do
  python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8 --top-k 1,2 --baselines cudnn --decode-lengths '' \
      --reps 10 --budget 1.0 --max-call-seconds 6 --skip-nan-checks --out $OUT/run$run > $OUT/run${run}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/run${run}_stdout.txt; tail -4 $OUT/run${run}_stdout.txt
done
rm -f $OUT/*/*.png  # 6 files come back
