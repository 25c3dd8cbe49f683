#!/bin/bash
# Session 12, call G (nvidia-h200-x2; call H reuses /tmp): GGUF half 1, windows and the gguf wheel to /tmp; CUDA tests
# of the review fixes (GPU 0, both visible for the 2-GPU test) beside the v8 profile (GPU 1).
cp scratch/gguf.part00 /tmp/part00; cp scratch/windows1024.pt /tmp/windows1024.pt
python3 -m pip install -q --no-index --no-deps --target /tmp/site scratch/whl/*.whl
mkdir -p /tmp/r; R=/tmp/r
export PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
CUDA_VISIBLE_DEVICES=1 OUT=$R timeout 330 python3 scratch/profile_v8.py > $R/profile_v8.txt 2>&1 &
timeout 440 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_gather.py \
    tests/ops/test_focus_triton.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_groups.py \
    tests/ops/test_focus_decode.py tests/ops/test_sfa_cache.py tests/ops/test_flash_sfa.py > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error|SKIP" $R/pytest_cuda.txt | tail -30
wait
tail -5 $R/profile_v8.txt
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
