#!/bin/bash
# Session 36, call B, on the tree with the shrinking pool units (sieve_attn/ops/sfa/decode.py, pool_units): the
# probe of the step beside 373477a's (carried as scratch/_decode_373477a.py) at 32K-128K, and with the pool at
# shorter chunks (_POOL_FROM_TILES=8); the gated decode rows of `sieve bench sfa`; the CUDA tests of both decode
# kernels, the merge and SFA generation.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_b; mkdir -p $R
timeout 200 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 32K,64K,128K --rounds 7 \
    --variants '_decode_373477a,decode,decode:_POOL_FROM_TILES=8' --out $R/probe > $R/probe.txt 2>&1
echo "probe exit $?" >> $R/probe.txt; grep -c '"ms"' $R/probe.txt; grep "FAIL\|exit\|Error" $R/probe.txt
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $R/bench > $R/bench.txt 2>&1
echo "bench exit $?" >> $R/bench.txt; grep "^| decode\|exit" $R/bench.txt
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $R/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $R/pytest_cuda.txt; tail -n 3 $R/pytest_cuda.txt
tar czf $OUT/call_b.tgz -C /tmp/r call_b
