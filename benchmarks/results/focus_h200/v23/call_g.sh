#!/bin/bash
# Call G (session 30), on commit 670e87e: how fast the Focus decode kernel streams the rows it gathers, by density.
# Kernel timelines at 128K, D = 128, top-1 over K = 1 (every key attended: the list is the whole cache, in order),
# 2, 4 and 8 random balanced groups (1/2, 1/4, 1/8 of the keys, scattered), beside dense SDPA-cuDNN.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py sieve_attn/ops/split_k.py > $OUT/digests.txt
for groups in 1 2 4 8; do
  timeout 100 python3 benchmarks/decode_timeline.py --kernel focus --topk 1 --groups $groups --out $OUT/k$groups \
      > /tmp/timeline.txt 2>&1
  echo "timeline exit $?" >> /tmp/timeline.txt
  (echo "== K=$groups"; cat /tmp/timeline.txt) >> $OUT/timeline_stdout.txt
  grep -A1 '"0:\|FAIL\|exit' /tmp/timeline.txt | grep 'dur_us\|FAIL\|exit\|"0:'
done
