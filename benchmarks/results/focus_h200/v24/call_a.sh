#!/bin/bash
# Call A (session 31), Focus decode v24: one list per (chunk, row block) for every KV head, built by a list kernel
# ahead of the attention programs (a programmatic dependent launch). The CUDA tests of the Focus decode kernels and
# the merge; the probe against v23 (_decode_v23, the committed kernels) with the prefetch depth and the plan varied,
# 8K to 256K at D = 128; the gated decode rows of the bench on this tree.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/*decode*.py sieve_attn/ops/split_k.py sieve_attn/ops/triton_common.py > $OUT/digests.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_decode.py tests/ops/test_merge.py \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
VARIANTS="_decode_v23,decode,decode:_PREFETCH_KEYS=0,decode:_PREFETCH_KEYS=16,decode:_PROGRAMS_PER_SM=6;_MAX_CHUNK_TILES=1000000,decode:_MAX_CHUNK_TILES=16"
timeout 260 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths 8K,32K,64K,128K,256K --rounds 5 \
    --head-dim 128 --out $OUT/d128 --variants "$VARIANTS" > $OUT/probe_d128_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_d128_stdout.txt; grep -c '"ms"' $OUT/probe_d128_stdout.txt
grep 'FAIL\|exit' $OUT/probe_d128_stdout.txt
timeout 130 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
