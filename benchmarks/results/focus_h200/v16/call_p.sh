#!/bin/bash
# v16 call P: the CUDA tests of the decomposition and the bench after call N's layout change (the sdpa backend's
# top-2 backward builds the Triton group layout).
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -x tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py tests/test_bench_focus.py \
    -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
