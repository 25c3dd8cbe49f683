#!/bin/bash
# v15 call K (to run; written in session 19): the bench at D=64, never run on a GPU. Every baseline (cuDNN,
# flash, FlexAttention, the same-group prototype), K = 4, 8, 16, top-1 and top-2, forward to 256K, forward+backward
# to 64K, decode 8K-128K (plain launches here; call J times decode as CUDA graphs). About 5-8 minutes (estimated).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m sieve_attn.cli bench focus --head-dims 64 --lengths 4K,16K,64K,256K --groups 4,8,16 --top-k 1,2 \
    --backward --max-backward-length 64K --decode-lengths 8K,32K,128K --baselines cudnn,flash,flex,prototype \
    --reps 5 --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $OUT/d64 > $OUT/d64_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/d64_stdout.txt; tail -40 $OUT/d64_stdout.txt
