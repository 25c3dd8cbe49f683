#!/bin/bash
# Call L (same machine as call K): the best retrofit setting (K=8, w=256, causal training routing, 300 steps) from two
# more seeded random starts, one per GPU, scored on all held-out windows.
source scratch/env.sh
export PYTHONUNBUFFERED=1
for seed in 1 2; do
  CUDA_VISIBLE_DEVICES=$((seed - 1)) timeout 280 python3 benchmarks/retrofit_sweep.py --windows /tmp/windows1024.pt \
      --configs w256-causal --steps 300 --batch-size 8 --max-top-k 2 --seed $seed --out $R/seed$seed \
      > $R/seed$seed.txt 2>&1 &
done
wait
for seed in 1 2; do tail -n 4 $R/seed$seed.txt; done
pack
