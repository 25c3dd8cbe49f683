#!/bin/bash
# Call N (same machine as call M): the gate decision in the final setting: the multiplicative gate with K=8, w=256,
# causal training routing, 300 steps, seeds 1 and 2 (the log gate's runs of call L used the same seeds).
source scratch/env.sh
export PYTHONUNBUFFERED=1
for seed in 1 2; do
  CUDA_VISIBLE_DEVICES=$((seed - 1)) timeout 280 python3 benchmarks/retrofit_sweep.py --windows /tmp/windows1024.pt \
      --configs mult-w256-causal --steps 300 --batch-size 8 --max-top-k 2 --seed $seed --out $R/mult_seed$seed \
      > $R/mult_seed$seed.txt 2>&1 &
done
wait
for seed in 1 2; do tail -n 4 $R/mult_seed$seed.txt; done
pack
