#!/bin/bash
# v18 call V (session 21): the headline rows again on the final code, backend auto (what a user gets):
# 64K forward and forward+backward, 256K and 1M forward, K=8 and 16, top-1 and top-2; then the 128K decode rows at
# D=128 as CUDA graphs. The last figures of these rows were taken on v13-v16 code.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8,16 --top-k 1,2 --baselines cudnn \
    --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 --max-call-seconds 6 \
    --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -12 $OUT/bench_stdout.txt
timeout 200 python3 -m sieve_attn.cli bench focus --lengths 256K,1M --groups 8,16 --top-k 1,2 --baselines cudnn \
    --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 20 --skip-nan-checks --out $OUT/bench_long \
    > $OUT/bench_long_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_long_stdout.txt; tail -10 $OUT/bench_long_stdout.txt
timeout 60 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode > $OUT/decode_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/decode_stdout.txt; tail -4 $OUT/decode_stdout.txt
rm -f $OUT/*/*.png  # 6 files come back
