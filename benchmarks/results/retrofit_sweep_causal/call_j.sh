#!/bin/bash
# Call J (same machine as call I): router-only retrofit, soft gate trained on causal routing, 300 steps, two configs per
# GPU, scored on all held-out windows.
source scratch/env.sh
export PYTHONUNBUFFERED=1
run() {  # gpu configs
  CUDA_VISIBLE_DEVICES=$1 timeout 570 python3 benchmarks/retrofit_sweep.py --windows /tmp/windows1024.pt \
      --configs $2 --steps 300 --batch-size 8 --max-top-k 4 --out $R/sweep_causal300 > $R/sweep_gpu$1.txt 2>&1
}
run 0 w256-causal,w384-causal & run 1 w256-k16-causal,w384-k16-causal &
wait
for f in $R/sweep_gpu*.txt; do tail -n 12 $f; done
pack
