#!/bin/bash
# Call C (session 30): the Focus decode plan by cache length. Call B found 3 programs per SM ahead of 6 at 32K and
# behind at 128K; the probe tries a floor on the attention tiles per chunk (split_k.plan's min_chunk_tiles) against
# fixed programs per SM, from 8K to 128K, at D = 128 (64-key tiles) and D = 64 (128-key tiles).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py sieve_attn/ops/split_k.py > $OUT/digests.txt
for dim in 128 64; do
  timeout 270 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths 8K,16K,32K,64K,128K --rounds 5 \
      --head-dim $dim --out $OUT/d$dim \
      --variants decode,decode:_MIN_CHUNK_TILES=6,decode:_MIN_CHUNK_TILES=10,decode:_MIN_CHUNK_TILES=16,decode:_PROGRAMS_PER_SM=3,decode:_PROGRAMS_PER_SM=4 \
      > $OUT/probe_d${dim}_stdout.txt 2>&1
  echo "probe exit $?" >> $OUT/probe_d${dim}_stdout.txt
  grep '"ms"\|FAIL\|exit' $OUT/probe_d${dim}_stdout.txt | sed 's/"rounds": \[[^]]*\], //; s/"variant": //; s/"D": //; s/"x_dense"/x/'
done
