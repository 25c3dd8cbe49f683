#!/bin/bash
# Session 40, call C (named nvidia-h200), the last device minutes: on an H200 only the gated decode rows at 128K,
# D = 128, k = 8 and 16; on any card the rewritten document_starts (fc6c6ec) on CUDA tensors against the CPU's.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 170 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $OUT/h200_decode > $OUT/h200_decode.txt 2>&1
  echo "bench exit $?" >> $OUT/h200_decode.txt; grep "^| decode\|exit" $OUT/h200_decode.txt
fi
python3 - <<'PY' 2>&1 | tee $OUT/starts_cuda.txt
import torch
from sieve_attn.ops.focus.routing import document_starts
from tests.ops.test_routing import _causal_mask
masks = torch.cat([_causal_mask(11, [4, 2, 5]), _causal_mask(11, [3, 6], pads=2)])
shared = _causal_mask(11, [4, 2, 5]).expand(3, 1, 11, 11)
for name, m in (("rows", masks), ("shared", shared)):
    print(name, "cpu", document_starts(m, 0, 11), "cuda", document_starts(m.cuda(), 0, 11))
PY
