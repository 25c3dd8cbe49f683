#!/bin/bash
# Call B (same machine as call A): 600-step dense and SFA k=16 (warm-up 100) runs with early stopping, one per GPU.
source scratch/env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site scratch/whl/*.whl
timeout 570 python3 benchmarks/sfa_finetune_sweep.py --out $R/sweep600es --gpus 0,1 --configs dense,k16-l1-warm100 \
    -- --device cuda --context 1024 --steps 600 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every 100 \
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa > $R/sweep600es.txt 2>&1
tail -12 $R/sweep600es.txt
pack
