#!/bin/bash
# Session 44, call A: the SFA decode step with the query table built inside the decode kernel (no table launch;
# the pool counters kept by the cache and reset by the program holding each row block's last ticket) against the
# committed step (session 42's tree, copied to sieve_attn/ops/sfa/_decode_v13.py), gated, interleaved rounds,
# GQA 32/8, D = 128, on whichever card runs it (versions.txt names it).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
timeout ${PROBE_SECONDS:-300} python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths ${LENGTHS:-128K,32K} \
    --rounds ${ROUNDS:-7} --variants "${VARIANTS:-decode,_decode_v13}" --out $OUT/probe > $OUT/probe.txt 2>&1
echo "probe exit $?" >> $OUT/probe.txt; grep '"ms"\|FAIL\|exit\|Error' $OUT/probe.txt | cut -c1-160
timeout ${TEST_SECONDS:-150} python3 -m pytest -q -x tests/ops/test_sfa_cache.py -k "decode or pool or units or sparsif" \
    > $OUT/tests.txt 2>&1; echo "tests exit $?" >> $OUT/tests.txt; tail -3 $OUT/tests.txt
