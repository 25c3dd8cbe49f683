#!/bin/bash
# Session 49, call B (the H200 of call A, warm, at once): the gated `sieve bench sfa` decode rows at 128K three more
# times, each its own process (the command as run, on one line there).
export PYTHONPATH=$PWD
for run in 3 4 5; do
  timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench$run > $OUT/bench_run$run.txt 2>&1
  echo "bench exit $?" >> $OUT/bench_run$run.txt; grep "^| decode\|exit" $OUT/bench_run$run.txt
  cp /tmp/bench$run/bench_sfa.json $OUT/bench_sfa_run$run.json
done
nvidia-smi --query-gpu=name --format=csv,noheader
