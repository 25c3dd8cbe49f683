#!/bin/bash
# Session 39, call B (named nvidia-h200), after 83fdef5: FlexAttention compiled with static shapes (call A's one
# failure), sinks at each packed sequence's start. On an H200 (issue 4's card) first the gated decode rows of
# `sieve bench sfa` at 128K, D = 128, k = 8 and 16, and `sieve bench focus --backward` at 64K. On any card: the CUDA
# tests of FlexAttention, causality, routing, the Focus bench, the transformers integration and the sdpa/Triton
# backends.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $OUT/h200_decode > $OUT/h200_decode.txt 2>&1
  echo "bench exit $?" >> $OUT/h200_decode.txt; grep "^| decode\|exit" $OUT/h200_decode.txt
  timeout 200 python3 -m sieve_attn.cli bench focus --lengths 64K --head-dims 128 --groups 8 --top-k 1 \
      --backward --decode-lengths '' --out $OUT/h200_focus_bwd > $OUT/h200_focus_bwd.txt 2>&1
  echo "bench focus exit $?" >> $OUT/h200_focus_bwd.txt; tail -n 8 $OUT/h200_focus_bwd.txt
fi
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_flex.py tests/ops/test_causality.py tests/ops/test_routing.py \
    tests/test_bench_focus.py tests/integrations/test_transformers.py \
    tests/ops/test_focus_sdpa.py tests/ops/test_focus_triton.py \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 3 $OUT/pytest_cuda.txt
