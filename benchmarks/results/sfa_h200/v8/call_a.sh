#!/bin/bash
# Call A (session 24): keys-major decode tiles. CUDA tests of both decode kernels and the SFA cache on the new tree;
# the probe on the new tree (D=128), on the previous commit's package (scratch/head = git archive HEAD sieve_attn),
# then the new tree at D=64.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,power.limit --format=csv
P=benchmarks/results/sfa_h200/v8/keys_major_probe.py
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_sfa_cache.py \
    tests/ops/test_focus_decode.py > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt
PYTHONPATH=$PWD PROBE_DIMS=128 timeout 200 python3 $P $OUT new > $OUT/probe_new_128.txt 2>&1
echo "exit $?" >> $OUT/probe_new_128.txt
PYTHONPATH=$PWD/scratch/head PROBE_DIMS=128 timeout 100 python3 -c "import sieve_attn; print(sieve_attn.__file__)" > $OUT/probe_head_128.txt 2>&1
PYTHONPATH=$PWD/scratch/head PROBE_DIMS=128 timeout 100 python3 $P $OUT head >> $OUT/probe_head_128.txt 2>&1
echo "exit $?" >> $OUT/probe_head_128.txt
PYTHONPATH=$PWD PROBE_DIMS=64 timeout 120 python3 $P $OUT new > $OUT/probe_new_64.txt 2>&1
echo "exit $?" >> $OUT/probe_new_64.txt
tail -n 3 $OUT/pytest_cuda_stdout.txt
for f in $OUT/probe_*.txt; do echo "== $f"; grep -o '"kernel": "[a-z]*".*"ms": [0-9.]*' $f | sed 's/"dense_ms": [0-9.]*, //; s/"tag": "[a-z]*", //' | cut -c1-200; grep -E "FAIL|Error|exit" $f | cut -c1-200; done
