#!/bin/bash
# Session 37, call B, after the review fixes (fddb84a): on an H200 (issue 4's card) first the gated decode rows of
# `sieve bench sfa` twice and the probe beside 373477a's step and two pool settings (session 36's call E); on any
# card the CUDA tests of the files the fixes touched: both decode kernels, FlashSFA, the SFA cache in generation,
# static caches and the Triton-backend generation of the transformers integration.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_b; mkdir -p $R
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
  for i in 1 2; do
    timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 \
        --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out $R/h200_bench_$i \
        > $R/h200_bench_$i.txt 2>&1
    echo "bench exit $?" >> $R/h200_bench_$i.txt; grep "^| decode\|exit" $R/h200_bench_$i.txt
  done
  timeout 150 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 7 \
      --variants '_decode_373477a,decode,decode:_POOLED=0.15,decode:_UNIT_TILES=2' --out $R/probe > $R/probe.txt 2>&1
  echo "probe exit $?" >> $R/probe.txt; grep "FAIL\|exit\|Error" $R/probe.txt
  rm sieve_attn/ops/sfa/_decode_373477a.py
fi
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py tests/ops/test_flash_sfa.py \
    tests/integrations/test_sfa_cache.py tests/integrations/test_sfa_compose.py \
    tests/integrations/test_transformers.py -k 'not gpt2_124m' > $R/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $R/pytest_cuda.txt; tail -n 2 $R/pytest_cuda.txt
tar czf $OUT/call_b.tgz -C /tmp/r call_b
