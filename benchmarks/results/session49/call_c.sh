#!/bin/bash
# Session 49, call C (named nvidia-h200): what the k that keeps a head dim of 64 within 5% of dense quality (k=20;
# docs/results.md, the top-k sweep) costs in a decode step, beside k = 16 and 24, at D = 64 and 128: the gated
# `sieve bench sfa` decode rows, 8K-128K cached tokens, GQA 32/8, CUDA graphs. Exits on a card other than an H200.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200"; exit 3; }
timeout 400 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 16,20,24 \
    --decode-lengths 8K,32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_k > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt
grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_k/bench_sfa.json /tmp/bench_k/*.png $OUT/ 2>/dev/null
ls $OUT
