#!/bin/bash
# Call C (same machine as call B, at once): the best k=16 recipe (PCA maps, importance selection, lambda 1, top-k
# warm-up 100, distilled from call B's dense fine-tune) on call B's text, steps and settings.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 570 python3 benchmarks/sfa_finetune_sweep.py --out /tmp/more --gpus 0 --configs k16-pca-imp-l1-warm100 \
    -- $(cat /tmp/common_args) --teacher /tmp/more/dense/model.safetensors > $OUT/sweep_sfa_stdout.txt 2>&1
echo "exit $?" >> $OUT/sweep_sfa_stdout.txt
mkdir -p $OUT/k16 && cp /tmp/more/k16-pca-imp-l1-warm100/result.json $OUT/k16/ && cp /tmp/more/sweep.json $OUT/
grep -h "PPL\|exit" $OUT/sweep_sfa_stdout.txt | tail -5
