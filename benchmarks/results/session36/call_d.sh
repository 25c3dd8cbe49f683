#!/bin/bash
# Session 36, call D, on the tree with shrinking pool units and the pool from 8-tile chunks: on an H200 (issue 4's
# card) the gated decode rows of `sieve bench sfa` twice and the probe beside 373477a's step
# (scratch/_decode_373477a.py); on any card the bench's decode rows at D = 64 and 128 and the CUDA tests of both
# decode kernels, the merge and SFA generation.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_d; mkdir -p $R
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  for i in 1 2; do
    timeout 90 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 \
        --decode-lengths 32K,64K,128K --reps 10 --cuda-graphs --skip-nan-checks --out $R/h200_bench_$i \
        > $R/h200_bench_$i.txt 2>&1
    echo "bench exit $?" >> $R/h200_bench_$i.txt; grep "^| decode\|exit" $R/h200_bench_$i.txt
  done
  timeout 150 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 64K,128K --rounds 7 \
      --variants '_decode_373477a,decode' --out $R/probe > $R/probe.txt 2>&1
  echo "probe exit $?" >> $R/probe.txt; grep "FAIL\|exit\|Error" $R/probe.txt
fi
timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 \
    --decode-lengths 8K,32K,64K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $R/bench > $R/bench.txt 2>&1
echo "bench exit $?" >> $R/bench.txt; grep "^| decode\|exit" $R/bench.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_focus_decode.py \
    tests/ops/test_merge.py tests/integrations/test_sfa_cache.py > $R/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $R/pytest_cuda.txt; tail -n 2 $R/pytest_cuda.txt
tar czf $OUT/call_d.tgz -C /tmp/r call_d
