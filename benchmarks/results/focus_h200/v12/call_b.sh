#!/bin/bash
# v12 call B (to run): what v11 left unmeasured. Top-2 at 1M (K=8, both fast backends); the old adjacent groups at
# 256K with the new code; one-token decode at 128K, K=8 top-1 and top-2, on both spreads (CUDA graphs).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m sieve_attn.cli bench focus --lengths 1M --groups 8 --top-k 2 --backends triton --baselines cudnn \
    --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 20 --skip-nan-checks --out $OUT/bench_1m \
    > $OUT/bench_1m_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_1m_stdout.txt; tail -6 $OUT/bench_1m_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 256K --groups 8 --top-k 2 --spread adjacent --backends triton \
    --baselines cudnn --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 6 --skip-nan-checks \
    --out $OUT/bench_adjacent > $OUT/bench_adjacent_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_adjacent_stdout.txt; tail -6 $OUT/bench_adjacent_stdout.txt
for spread in combinations adjacent; do
  python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --spread $spread --decode-lengths 128K \
      --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_$spread > $OUT/decode_${spread}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/decode_${spread}_stdout.txt; tail -6 $OUT/decode_${spread}_stdout.txt
done
rm -f $OUT/*/*.png  # at most 8 files come back
