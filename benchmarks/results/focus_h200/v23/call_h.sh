#!/bin/bash
# Call H (session 30): Focus decode with a register cap (Triton's maxnreg), so that an SM holds 4 programs (128
# registers, 8 bytes of stack) or 5 (96) instead of 3 (157), each plan in one wave; 32K, 64K, 128K, D = 128.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py sieve_attn/ops/split_k.py > $OUT/digests.txt
timeout 250 python3 benchmarks/decode_probe.py --kernel focus --topk 1,2 --lengths 32K,64K,128K --rounds 5 --out $OUT \
    --variants "decode,decode:_MAX_REGISTERS=128;_PROGRAMS_PER_SM=4,decode:_MAX_REGISTERS=128;_PROGRAMS_PER_SM=4;_MAX_CHUNK_TILES=24,decode:_MAX_REGISTERS=128;_PROGRAMS_PER_SM=8,decode:_MAX_REGISTERS=96;_PROGRAMS_PER_SM=5" \
    > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep 'FAIL\|exit\|error' $OUT/probe_stdout.txt | cut -c1-300
