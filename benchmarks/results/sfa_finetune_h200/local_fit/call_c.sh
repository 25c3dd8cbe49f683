#!/bin/bash
# Session 35, call C (same machine as call B, at once): SFA k = 16, the best recipe of session 23 (PCA maps,
# importance selection, matching weight 1, distilled from call B's dense fine-tune), three runs side by side on the
# one GPU: "pca" (the recipe as it is, top-k warm-up 100), "fit" (the same, with the maps then fitted layer by layer
# to the dense outputs before training: local_fit.py, 200 Adam steps at 2e-3 on the 16 calibration windows), and
# "fit-nowarm" (fitted maps, no top-k warm-up, so training starts from the fitted maps at k = 16).
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
F=benchmarks/results/sfa_finetune_h200/local_fit/local_fit.py
SFA="--method sfa --topk 16 --matching-weight 1 --feature-map pca --selection importance
    --teacher /tmp/lf/dense/model.safetensors $(cat /tmp/common_args)"
FIT_STEPS=0 timeout 570 python3 $F finetune $SFA --topk-warmup 100 --out /tmp/lf/pca > /tmp/lf/pca.txt 2>&1 &
FIT_STEPS=200 timeout 570 python3 $F finetune $SFA --topk-warmup 100 --out /tmp/lf/fit > /tmp/lf/fit.txt 2>&1 &
FIT_STEPS=200 timeout 570 python3 $F finetune $SFA --out /tmp/lf/fit-nowarm > /tmp/lf/fit-nowarm.txt 2>&1 &
wait
for run in pca fit fit-nowarm; do
  mkdir -p $OUT/$run; cp /tmp/lf/$run/result.json $OUT/$run/ 2>/dev/null
  echo "== $run"; grep -v "Warn" /tmp/lf/$run.txt | tr '\r' '\n' | grep -v "it/s\|s/it" | tail -4
done > $OUT/sfa_stdout.txt
cat $OUT/sfa_stdout.txt | cut -c1-400
nvidia-smi --query-gpu=name,memory.used --format=csv
