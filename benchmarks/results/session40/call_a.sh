#!/bin/bash
# Session 40, call A (named nvidia-h200): on an H200 the gated decode rows of `sieve bench sfa` at 128K, D = 128,
# k = 8 and 16 (issue 4's decode figure, never measured on an H200 since session 28's kernel changes). On any other
# card it only prints what it got, so that a start that gives an H100 costs as little as it can.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
git rev-parse HEAD 2>/dev/null | tee -a $OUT/versions.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  for rep in 1 2; do
    timeout 200 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K \
        --reps 10 --cuda-graphs --skip-nan-checks --out $OUT/h200_decode_$rep > $OUT/h200_decode_$rep.txt 2>&1
    echo "bench exit $?" >> $OUT/h200_decode_$rep.txt; grep "^| decode\|exit" $OUT/h200_decode_$rep.txt
  done
fi
