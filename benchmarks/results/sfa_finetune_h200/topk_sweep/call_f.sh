#!/bin/bash
# Session 35, call F (same machine as call E, at once; run as one inline command, kept here): SFA at k = 20 by the
# same recipe, distilled from call E's dense fine-tune.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 330 python3 -m sieve_attn.cli finetune --method sfa --topk 20 --matching-weight 1 --feature-map pca \
    --selection importance --topk-warmup 100 --teacher /tmp/lf/dense/model.safetensors --device cuda --context 1024 \
    --steps 400 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every 400 --validate-every 50 \
    --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16 --out /tmp/lf/k20 > /tmp/lf_k20.txt 2>&1
mkdir -p $OUT/k20; cp /tmp/lf/k20/result.json $OUT/k20/
tr '\r' '\n' < /tmp/lf_k20.txt | grep "held-out PPL\|Error"
