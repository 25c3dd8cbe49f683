#!/bin/bash
# v15 call L (session 20): decode._SCAN_N, _SCAN_STAGES = 256, 3 after call J's probe: the CUDA decode tests and the gated decode
# bench, then v15/call_k.sh (D=64).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -x tests/ops/test_focus_decode.py -p no:cacheprovider > $OUT/pytest_decode_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_decode_stdout.txt; tail -2 $OUT/pytest_decode_stdout.txt
for spread in combinations adjacent; do
  python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --spread $spread \
      --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_$spread \
      > $OUT/decode_${spread}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/decode_${spread}_stdout.txt; tail -7 $OUT/decode_${spread}_stdout.txt
done
rm -f $OUT/*/*.png
timeout 380 bash benchmarks/results/focus_h200/v15/call_k.sh
rm -f $OUT/*/*.png
