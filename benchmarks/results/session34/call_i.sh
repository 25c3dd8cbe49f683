#!/bin/bash
# Session 34, call I (H100; inline, kept here): SFA decode at 128K, k = 16, in the gated bench with 20 warm-up calls
# and 10 timed, 3 and 50, and 3 and 10 (the default then), in that order, one process each.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; mkdir -p /tmp/r/wr
for spec in "20 10" "3 50" "3 10"; do
  set -- $spec
  timeout 40 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 16 --decode-lengths 128K \
      --warmup $1 --reps $2 --cuda-graphs --skip-nan-checks --out /tmp/r/wr/w$1_r$2 > /tmp/r/wr/w$1_r$2.txt 2>&1
  echo "warmup $1 reps $2"; grep "^| decode" /tmp/r/wr/w$1_r$2.txt
done
tar czf $OUT/wr.tgz -C /tmp/r wr
