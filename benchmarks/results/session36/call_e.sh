#!/bin/bash
# Session 36, call E: call D's H200 rows only (issue 4's card), the probe with two pool settings besides (a 15%
# pool, units from 2 tiles); on any other card it stops at once.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
R=/tmp/r/call_e; mkdir -p $R
for i in 1 2; do
  timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 \
      --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out $R/h200_bench_$i \
      > $R/h200_bench_$i.txt 2>&1
  echo "bench exit $?" >> $R/h200_bench_$i.txt; grep "^| decode\|exit" $R/h200_bench_$i.txt
done
timeout 150 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 7 \
    --variants '_decode_373477a,decode,decode:_POOLED=0.15,decode:_UNIT_TILES=2' --out $R/probe > $R/probe.txt 2>&1
echo "probe exit $?" >> $R/probe.txt; grep "FAIL\|exit\|Error" $R/probe.txt
tar czf $OUT/call_e.tgz -C /tmp/r call_e
