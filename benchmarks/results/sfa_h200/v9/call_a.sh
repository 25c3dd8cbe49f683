#!/bin/bash
# Call A (session 25): SFA decode reading packed indices as 4-byte words. The previous commit's package
# (scratch/head, carried) at its defaults, then the new tree with its plan swept, both gated against float64; then
# the CUDA tests of the SFA cache, its decode kernel and the SFA generation path on the new tree.
set -u
export PYTHONUNBUFFERED=1
P=benchmarks/results/sfa_h200/v9/index_words_probe.py
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > $OUT/gpu.txt 2>&1
PYTHONPATH=$PWD/scratch/head PROBE_PLAN=defaults timeout 150 python3 $P $OUT head > $OUT/probe_head.txt 2>&1
echo "exit $?" >> $OUT/probe_head.txt
PYTHONPATH=$PWD PROBE_PLAN=plan timeout 240 python3 $P $OUT new > $OUT/probe_new.txt 2>&1
echo "exit $?" >> $OUT/probe_new.txt
PYTHONPATH=$PWD timeout 180 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py \
    tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt
grep -h "dense sdpa\|exit" $OUT/probe_*.txt
grep -h '"kernel": "sfa"' $OUT/probe_*.txt | python3 -c "
import json,sys
for l in sys.stdin:
    ok = not l.startswith('FAIL'); r = json.loads(l[5:] if not ok else l)
    print(r['tag'], r['D'], r['topk'], r.get('_NUM_STAGES'), r.get('_PROGRAMS_PER_SM'), 'ok' if ok else 'FAIL', round(r.get('err_ratio', -1), 2), r.get('ms'), round(r.get('x_dense', 0), 3), r.get('error', ''))"
tail -n 3 $OUT/pytest_cuda.txt
