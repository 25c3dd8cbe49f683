#!/bin/bash
# Session 34, call H (H100; run as one inline command, kept here), after bench.timing.graphed was changed to keep
# the captured step alive: per-replay times of graphed decode steps (replay_series.py: dense, SFA k = 16 and 8 at
# 128K, 200 flushed replays after 0.5 s idle, three times), then the gated SFA decode bench twice with its default
# warm-up (3 calls, 10 timed) and the Focus decode bench once.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; mkdir -p /tmp/r/fix
timeout 60 python3 benchmarks/results/session34/replay_series.py /tmp/r/fix/replay_series.json 2>&1 | grep -v Warn
for i in 1 2; do
  timeout 60 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/r/fix/sfa_$i > /tmp/r/fix/sfa_$i.txt 2>&1
  grep "^| decode" /tmp/r/fix/sfa_$i.txt
done
timeout 60 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 32K,128K \
    --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/r/fix/focus > /tmp/r/fix/focus.txt 2>&1
grep "^| decode" /tmp/r/fix/focus.txt; tar czf $OUT/fix.tgz -C /tmp/r fix
