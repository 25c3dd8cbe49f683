#!/bin/bash
# Call O (nvidia-h200): forward benches with the routed groups a model passes (no per-call validation read).
mkdir -p /tmp/r; R=/tmp/r; rm -rf /tmp/r/*
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m sieve_attn.cli bench focus --backend triton --backends sdpa --lengths 16K,64K,256K,1M \
    --groups 8,16 --top-k 1 --decode-lengths '' --baselines cudnn,prototype --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $R/bench_top1_routed > $R/bench_top1_routed.txt 2>&1
tail -18 $R/bench_top1_routed.txt
timeout 80 python3 -m sieve_attn.cli bench focus --backend triton --lengths 64K,256K --groups 8 --top-k 2 \
    --decode-lengths '' --baselines cudnn --reps 5 --budget 0.5 --max-call-seconds 6 --skip-nan-checks \
    --out $R/bench_top2_routed > $R/bench_top2_routed.txt 2>&1
tail -4 $R/bench_top2_routed.txt
tar czf $OUT/results.tgz -C $R .
