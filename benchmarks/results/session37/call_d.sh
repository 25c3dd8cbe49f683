#!/bin/bash
# Session 37, call D, after the Focus review fixes (d52517f): on an H200 (issue 4's card) first call C's decode rows
# and probe; on any card the CUDA tests of the transformers integration (routing kept per cache, beam search
# refused, static caches, the hand-built hard pattern, Triton-backend generation), FocusGroups and Focus decode.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_d; mkdir -p $R
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  cp scratch/_decode_373477a.py sieve_attn/ops/sfa/
  timeout 100 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $R/h200_bench > $R/h200_bench.txt 2>&1
  echo "bench exit $?" >> $R/h200_bench.txt; grep "^| decode\|exit" $R/h200_bench.txt
  timeout 120 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 7 \
      --variants '_decode_373477a,decode' --out $R/probe > $R/probe.txt 2>&1
  echo "probe exit $?" >> $R/probe.txt; grep "FAIL\|exit\|Error" $R/probe.txt
  rm sieve_attn/ops/sfa/_decode_373477a.py
fi
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/integrations/test_transformers.py \
    tests/ops/test_focus_groups.py tests/ops/test_focus_decode.py -k 'not gpt2_124m' > $R/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $R/pytest_cuda.txt; tail -n 2 $R/pytest_cuda.txt
tar czf $OUT/call_d.tgz -C /tmp/r call_d
