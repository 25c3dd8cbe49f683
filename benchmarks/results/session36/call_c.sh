#!/bin/bash
# Session 36, call C, on the tree with the pool from 8-tile chunks (_POOL_FROM_TILES = 8): the probe at 8K-32K
# beside the pool at every chunk length (_POOL_FROM_TILES=0) and 373477a's step (scratch/_decode_373477a.py), and
# at 128K beside a 15% pool.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_c; mkdir -p $R
timeout 200 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 8K,16K,32K --rounds 7 \
    --variants '_decode_373477a,decode,decode:_POOL_FROM_TILES=0' --out $R/probe_short > $R/probe_short.txt 2>&1
echo "probe exit $?" >> $R/probe_short.txt; grep "FAIL\|exit\|Error" $R/probe_short.txt
timeout 200 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 7 \
    --variants '_decode_373477a,decode,decode:_POOLED=0.15' --out $R/probe_128k > $R/probe_128k.txt 2>&1
echo "probe exit $?" >> $R/probe_128k.txt; grep "FAIL\|exit\|Error" $R/probe_128k.txt
tar czf $OUT/call_c.tgz -C /tmp/r call_c
