#!/bin/bash
# v14 call H (v13's code): the share of a forward outside attention at 64K and 256K (sdpa, top-1 and top-2) and at
# 8K (Triton, top-1); then where auto's switch to the sdpa backend belongs (GROUP_CALL_FROM, 4K tokens per group):
# top-1 at 2K-16K tokens per group, both fast backends, forward and forward+backward, two runs.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/results/focus_h200/v14/profile_share.py 65536 262144 > $OUT/share_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/share_stdout.txt; cat $OUT/share_stdout.txt
for run in 1 2; do
  python3 -m sieve_attn.cli bench focus --lengths 16K,32K,64K --groups 4,8,16 --top-k 1 --backends sdpa,triton \
      --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 10 --budget 0.5 \
      --max-call-seconds 6 --skip-nan-checks --out $OUT/sweep_$run > $OUT/sweep_${run}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/sweep_${run}_stdout.txt; grep -c "| ok |" $OUT/sweep_${run}_stdout.txt
done
rm -f $OUT/*/*.png  # at most 8 files come back
