#!/bin/bash
# Call B (session 24): the chosen variant as the tree's default (keys-major tiles, P rounded once to 16 bits, SFA's
# V tile through TMA): the CUDA tests of both decode kernels, the SFA cache and the generation paths; then the plan
# re-swept (stages, programs per SM, SFA tiles) at D=128.
set -u
export PYTHONUNBUFFERED=1
P=benchmarks/results/sfa_h200/v8/keys_major_probe.py
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py \
    tests/ops/test_focus_decode.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt
PYTHONPATH=$PWD PROBE_PLAN=plan PROBE_DIMS=128 timeout 300 python3 $P $OUT new > $OUT/probe_plan_128.txt 2>&1
echo "exit $?" >> $OUT/probe_plan_128.txt
tail -n 5 $OUT/pytest_cuda_stdout.txt
grep -E "FAIL|Error|exit" $OUT/probe_plan_128.txt | cut -c1-300
