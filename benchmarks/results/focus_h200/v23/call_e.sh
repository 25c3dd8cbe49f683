#!/bin/bash
# Call E (session 30), on the committed tree of Focus decode v23 (bound of 32 tiles a chunk): the CUDA tests of the
# Focus decode kernel and the merge, the gated decode rows of `sieve bench focus`, and the kernel timeline of a 128K
# step (benchmarks/decode_timeline.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py sieve_attn/ops/split_k.py sieve_attn/ops/triton_common.py > $OUT/digests.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_decode.py tests/ops/test_merge.py \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
timeout 130 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
timeout 120 python3 benchmarks/decode_timeline.py --kernel focus --topk 1,2 --out $OUT > $OUT/timeline_stdout.txt 2>&1
echo "timeline exit $?" >> $OUT/timeline_stdout.txt; tail -n 40 $OUT/timeline_stdout.txt
