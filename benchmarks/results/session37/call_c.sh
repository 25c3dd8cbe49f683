#!/bin/bash
# Session 37, call C (little device time left): on an H200 only (issue 4's card), the gated decode rows of
# `sieve bench sfa` at 128K once and the probe of the committed step beside 373477a's; any other card stops at once.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
R=/tmp/r/call_c; mkdir -p $R
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
    --reps 10 --cuda-graphs --skip-nan-checks --out $R/h200_bench > $R/h200_bench.txt 2>&1
echo "bench exit $?" >> $R/h200_bench.txt; grep "^| decode\|exit" $R/h200_bench.txt
timeout 120 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 7 \
    --variants '_decode_373477a,decode' --out $R/probe > $R/probe.txt 2>&1
echo "probe exit $?" >> $R/probe.txt; grep "FAIL\|exit\|Error" $R/probe.txt
tar czf $OUT/call_c.tgz -C /tmp/r call_c
