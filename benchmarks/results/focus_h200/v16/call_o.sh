#!/bin/bash
# v16 call O: 128-key attention tiles in the decode kernel up to D=64 (decode._block_n; call N's probe): the CUDA
# decode tests, then the gated decode bench as CUDA graphs at D=64 and D=128 (combinations groups; adjacent at D=64).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -x tests/ops/test_focus_decode.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -2 $OUT/pytest_cuda_stdout.txt
for run in "64 combinations" "64 adjacent" "128 combinations"; do
  set -- $run
  python3 -m sieve_attn.cli bench focus --head-dims $1 --lengths '' --groups 8 --top-k 1,2 --spread $2 \
      --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_d$1_$2 \
      > $OUT/decode_d$1_$2_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/decode_d$1_$2_stdout.txt; tail -8 $OUT/decode_d$1_$2_stdout.txt
done
rm -f $OUT/*/*.png  # 7 files come back
