#!/bin/bash
# Session 39, call C (named nvidia-h200), after the FlexAttention fix (the main kernel forced, automatic dynamic
# shapes back). On an H200 first the gated decode rows of `sieve bench sfa` at 128K, D = 128, k = 8 and 16. On any
# card: the CUDA tests of the FlexAttention backend (its own, causality's) and the Focus bench's Flex baseline; pytest
# is stopped with SIGINT at its limit, so it still prints what failed. Trimmed after several refused starts.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $OUT/h200_decode > $OUT/h200_decode.txt 2>&1
  echo "bench exit $?" >> $OUT/h200_decode.txt; grep "^| decode\|exit" $OUT/h200_decode.txt
fi
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -k "flex or Flex" tests/ops/test_focus_flex.py \
    tests/ops/test_causality.py tests/test_bench_focus.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; grep -v "^DEBUG" $OUT/pytest_cuda.txt | tail -n 15
