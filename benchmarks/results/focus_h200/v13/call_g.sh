#!/bin/bash
# v13 call G: top-1 forward at 8K-64K on the Triton backend, whose top-1 path has no host read, timed as CUDA-graph
# replays (--cuda-graphs now covers forward calls too; cuDNN graphed alike), beside plain launches in the same call.
# --backends triton adds Triton rows beside the default backend's (auto: the sdpa backend from 4K tokens per group,
# whose host reads fail the capture, as its rows say).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for mode in plain graphs; do
  extra=""; [ $mode = graphs ] && extra="--cuda-graphs"
  python3 -m sieve_attn.cli bench focus --lengths 8K,16K,32K,64K --groups 8,16 --top-k 1 --backends triton \
      --baselines cudnn --decode-lengths '' --reps 10 --budget 0.5 --max-call-seconds 6 --skip-nan-checks $extra \
      --out $OUT/$mode > $OUT/${mode}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/${mode}_stdout.txt; tail -12 $OUT/${mode}_stdout.txt
done
rm -f $OUT/*/*.png  # at most 8 files come back
