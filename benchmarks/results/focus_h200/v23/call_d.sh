#!/bin/bash
# Call D (session 30), Focus decode v23 final: the one-position scan, the 64-key prefetch and the plan of whole waves
# (3 programs per SM, as many waves as keep a chunk within 24 tiles). The CUDA tests of the Focus decode kernel and
# the merge; the probe against v22 (the committed kernel, _decode_v22), the old plan (6 per SM, any chunk length)
# and the tile bound at 16 and 32, 8K to 256K at D = 128 and to 128K at D = 64; the gated decode rows of the bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/*decode*.py sieve_attn/ops/split_k.py sieve_attn/ops/triton_common.py > $OUT/digests.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_decode.py tests/ops/test_merge.py \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
VARIANTS="_decode_v22,decode,decode:_PROGRAMS_PER_SM=6;_MAX_CHUNK_TILES=1000000,decode:_MAX_CHUNK_TILES=16,decode:_MAX_CHUNK_TILES=32"
for dim in 128 64; do
  lengths=8K,16K,32K,64K,128K; [ $dim = 128 ] && lengths=$lengths,256K
  timeout 200 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths $lengths --rounds 5 \
      --head-dim $dim --out $OUT/d$dim --variants "$VARIANTS" > $OUT/probe_d${dim}_stdout.txt 2>&1
  echo "probe exit $?" >> $OUT/probe_d${dim}_stdout.txt; grep -c '"ms"' $OUT/probe_d${dim}_stdout.txt
  grep 'FAIL\|exit' $OUT/probe_d${dim}_stdout.txt
done
timeout 130 python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K \
    --reps 10 --skip-nan-checks --cuda-graphs --out /tmp/bench_focus > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; grep "^| decode\|exit" $OUT/bench_stdout.txt
cp /tmp/bench_focus/*.json /tmp/bench_focus/*.png $OUT/ 2>&1
