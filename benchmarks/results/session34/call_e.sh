#!/bin/bash
# Session 34, call E (the H100 of calls C and D, warm; run as one inline command, kept here): Focus forward at 1M
# (K = 8 and 16, top-1 and top-2, auto backend), SFA prefill at 16K-128K (forward, forward+backward to 64K, auto =
# the sdpa backend), and both decode kernels at D = 64 (SmolLM2's head dim) as CUDA graphs.
mkdir -p /tmp/r; pack() { tar czf $OUT/$1.tgz -C /tmp/r $1; }; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
b() { k=$1 n=$2 l=$3; shift 3; mkdir -p /tmp/r/$n
  timeout $l python3 -m sieve_attn.cli bench $k --skip-nan-checks --out /tmp/r/$n "$@" > /tmp/r/$n/stdout.txt 2>&1
  echo "bench exit $?" >> /tmp/r/$n/stdout.txt; pack $n; echo "== $n"; grep "^| \|exit\|FAIL" /tmp/r/$n/stdout.txt | tail -20; }
b focus focus_1m 170 --lengths 1M --groups 8,16 --top-k 1,2 --baselines cudnn --decode-lengths '' --reps 3 --budget 0.5 \
    --max-call-seconds 20
b sfa sfa_prefill 150 --lengths 16K,64K,128K --head-dims 128 --topk 8,16 --backward --max-backward-length 64K \
    --baselines cudnn --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 5
b focus focus_decode_d64 60 --head-dims 64 --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K --reps 10 \
    --cuda-graphs
b sfa sfa_decode_d64 60 --lengths '' --head-dims 64 --topk 8,16 --decode-lengths 8K,32K,128K --reps 10 --cuda-graphs
