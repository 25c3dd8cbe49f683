#!/bin/bash
# Session 40, call B (named nvidia-h200): on an H200 first the gated decode rows of `sieve bench sfa` at 32K and
# 128K, D = 128, k = 8 and 16 (issue 4's decode figure). On any card: the tests that meet a GPU only there, among
# this session's: a real DynamicCache(offloading=True) with Focus (the CPU runs a stand-in), and the mask reading
# of document_starts on CUDA tensors.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 200 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $OUT/h200_decode > $OUT/h200_decode.txt 2>&1
  echo "bench exit $?" >> $OUT/h200_decode.txt; grep "^| decode\|exit" $OUT/h200_decode.txt
fi
cat > /tmp/starts_cuda.py <<'PY'
import torch
from sieve_attn.ops.focus.routing import document_starts
from tests.ops.test_routing import _causal_mask
masks = torch.cat([_causal_mask(11, [4, 2, 5]), _causal_mask(11, [3, 6], pads=2)])
print("cpu", document_starts(masks, 0, 11), "cuda", document_starts(masks.cuda(), 0, 11))
PY
python3 /tmp/starts_cuda.py 2>&1 | tee $OUT/starts_cuda.txt
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -k "offloading or drafts or prompt_lookup" \
    tests/integrations/test_transformers.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 8 $OUT/pytest_cuda.txt
