#!/bin/bash
# Call H (same machine as call G): router-only retrofit with the soft gate trained on causal routing, one config per GPU.
source scratch/env.sh
export PYTHONUNBUFFERED=1
for i in 0 1; do
  config=$([ $i = 0 ] && echo w256-causal || echo w256-k16-causal)
  CUDA_VISIBLE_DEVICES=$i timeout 560 python3 benchmarks/retrofit_sweep.py --windows /tmp/windows1024.pt \
      --configs $config --steps 100 --batch-size 8 --eval-windows 48 --max-top-k 6 --out $R/sweep_causal \
      > $R/sweep_$config.txt 2>&1 &
done
wait
tail -8 $R/sweep_*.txt
pack
