#!/bin/bash
# v13 call F (call E's code, the machine still warm): a second gated run of the forward at 8K-64K, K=8, top-1 and
# top-2, both fast backends, to see the run-to-run spread of the 64K top-2 ratio.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; mkdir -p $OUT/r
python3 -m sieve_attn.cli bench focus --lengths 8K,16K,32K,64K --groups 8 --top-k 1,2 --backends sdpa,triton \
    --baselines cudnn --decode-lengths '' --reps 10 --budget 0.5 --max-call-seconds 6 --skip-nan-checks \
    --out $OUT/r > $OUT/repeat_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/repeat_stdout.txt; tail -30 $OUT/repeat_stdout.txt; rm -f $OUT/r/*.png
