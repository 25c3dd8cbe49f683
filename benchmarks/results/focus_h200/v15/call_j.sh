#!/bin/bash
# v15 call J (to run; written in session 19, when no device was lent after call H): the decode kernel's pass-1 scan
# in wider and pipelined steps (probe_decode_scan.py); the CUDA decode tests, which also run each plan of the
# scan against the measured one; then the gated decode bench at 8K-128K with the committed plan. Run v14/call_i.sh
# first (the CUDA tests of SDPA_FROM and the review's fixes). If a plan wins, set decode._SCAN_N / _SCAN_STAGES,
# rerun the decode tests and the bench, and record both in NOTES.md.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/ops/test_focus_decode.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
timeout 240 python3 benchmarks/results/focus_h200/v15/probe_decode_scan.py $OUT > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; cat $OUT/probe_stdout.txt
for spread in combinations adjacent; do
  python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --spread $spread \
      --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_$spread \
      > $OUT/decode_${spread}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/decode_${spread}_stdout.txt; tail -8 $OUT/decode_${spread}_stdout.txt
done
rm -f $OUT/*/*.png  # at most 8 files come back
