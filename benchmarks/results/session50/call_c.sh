#!/bin/bash
# Session 50, call C (after call B, same machine): the GPU tests of both decode steps, their plan and occupancy query.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 400 python3 -m pytest tests/ops/test_split_k.py tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    -q -x -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "tests exit $?" >> $OUT/tests.txt; tail -3 $OUT/tests.txt
