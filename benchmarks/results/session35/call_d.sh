#!/bin/bash
# Session 35, call D (a fresh machine): the wheel's first half to /tmp for call E; the bench tests on the GPU, among
# them session 34's CUDA-only test that a graphed step keeps what its graph reads alive (never run on a GPU before);
# on an H200, first call A's decode rows and the probe beside them (issue 4's 1.5x at 128K, k = 16).
set -u
cp scratch/p1/smol.00 /tmp/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  R=/tmp/r/decode; mkdir -p $R
  for i in 1 2; do
    timeout 90 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K \
        --reps 10 --cuda-graphs --skip-nan-checks --out $R/bench_$i > $R/bench_$i.txt 2>&1
    echo "bench exit $?" >> $R/bench_$i.txt; grep "^| decode\|exit" $R/bench_$i.txt
  done
  timeout 120 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 32K,128K --rounds 5 \
      --variants decode --out $R/probe > $R/probe.txt 2>&1
  echo "probe exit $?" >> $R/probe.txt; tail -12 $R/probe.txt
  tar czf $OUT/decode.tgz -C /tmp/r decode
fi
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_bench_focus.py tests/test_bench_sfa.py \
    > $OUT/pytest_bench.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_bench.txt
grep -E "passed|failed|^FAILED|ERROR|exit|graphed" $OUT/pytest_bench.txt | tail -8
