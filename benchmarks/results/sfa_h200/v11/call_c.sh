#!/bin/bash
# Call C (session 27): each program has L2 prefetch the first PREFETCH tiles of its chunk while it waits for the
# query table (decode._PREFETCH_TILES, 2 in the tree sent), side by side at 128K and 64K; then the SFA decode tests.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=benchmarks/results/sfa_h200/v11
B=0.1:4:5:8:256:32:24
PROBE_LENGTHS=131072,65536 timeout 200 python3 $P/step_probe.py $OUT $B:0,$B:1,$B:2,$B:4,$B:8 > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; grep '"ms"\|FAIL\|exit\|Error' $OUT/probe_stdout.txt | cut -c1-150
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/integrations/test_sfa_cache.py \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 2 $OUT/pytest_cuda.txt
