#!/bin/bash
# Session 34, call F (the same H100, warm; run as one inline command, kept here): the plan in whole waves
# (decode) against the plan before it (_decode_cdiv, see call_c.sh) at more shapes: SFA batch 5, Focus batch 2
# (D = 128), both at batch 8 with D = 64; then Focus forward at 8K and 16K (Triton backend) as CUDA graphs.
mkdir -p /tmp/r/probes2; pack() { tar czf $OUT/$1.tgz -C /tmp/r $1; }; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for spec in "sfa 16,8 5 128" "focus 1,2 2 128" "sfa 16,8 8 64" "focus 1,2 8 64"; do
  set -- $spec
  timeout 60 python3 benchmarks/decode_probe.py --kernel $1 --topk $2 --batch $3 --head-dim $4 --lengths 32K,128K \
      --rounds 5 --out /tmp/r/probes2/$1_b$3_d$4 --variants decode,_decode_cdiv > /tmp/r/probes2/$1_b$3_d$4.txt 2>&1
  echo "$spec exit $?"; grep FAIL /tmp/r/probes2/$1_b$3_d$4.txt
done; pack probes2
mkdir -p /tmp/r/focus_short
timeout 150 python3 -m sieve_attn.cli bench focus --skip-nan-checks --out /tmp/r/focus_short --lengths 8K,16K \
    --groups 8,16 --top-k 1 --backend triton --baselines cudnn --decode-lengths '' --reps 10 --budget 0.5 \
    --max-call-seconds 6 --cuda-graphs > /tmp/r/focus_short/stdout.txt 2>&1
echo "bench exit $?" >> /tmp/r/focus_short/stdout.txt; pack focus_short; grep "^| \|exit\|FAIL" /tmp/r/focus_short/stdout.txt
