#!/bin/bash
# Session 34, call D (the card that comes): the integration tests on the GPU again after call C (the Gemma-2 map
# test now compares with eager attention, and the weighted-codes test skips the CPU Triton path where no
# interpreter runs); then the gated benches on that card: Focus prefill at 64K (forward and forward+backward) and
# 256K (forward), K = 8 and 16, top-1 and top-2, auto backend, plain launches (as v19 call Z ran them on the H200);
# decode of both kernels at 8K-128K as CUDA graphs (batch 1, GQA 32/8, D = 128).
set -u
mkdir -p /tmp/r/tests
# At most 8 files come back: each stage writes under /tmp/r/STAGE and is packed into $OUT/STAGE.tgz at once.
pack() { tar czf $OUT/$1.tgz -C /tmp/r $1; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/versions.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/integrations > /tmp/r/tests/pytest_integrations.txt 2>&1
echo "pytest exit $?" >> /tmp/r/tests/pytest_integrations.txt; pack tests; grep -E "passed|failed|^FAILED|exit" /tmp/r/tests/pytest_integrations.txt | tail -6
bench() {
  local kind=$1 name=$2 limit=$3; shift 3; mkdir -p /tmp/r/$name
  timeout $limit python3 -m sieve_attn.cli bench $kind --skip-nan-checks --out /tmp/r/$name "$@" > /tmp/r/$name/stdout.txt 2>&1
  echo "bench exit $?" >> /tmp/r/$name/stdout.txt; pack $name
  echo "== $name"; grep "^| \|exit\|FAIL" /tmp/r/$name/stdout.txt | tail -24
}
bench focus focus_prefill 200 --lengths 64K,256K --groups 8,16 --top-k 1,2 --baselines cudnn --backward \
    --max-backward-length 64K --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 10
bench focus focus_decode 100 --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K --reps 10 --cuda-graphs
bench sfa sfa_decode 100 --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 8K,32K,128K --reps 10 --cuda-graphs
