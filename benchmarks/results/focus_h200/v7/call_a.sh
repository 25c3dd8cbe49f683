#!/bin/bash
# Session 11, device call A (nvidia-h200-x2; call B reuses /tmp): GGUF half 1 and the gguf wheel to /tmp; CUDA tests of
# the Focus backends (the sdpa backend's window set is now the Triton window kernel); top-1 prefill triton vs sdpa
# (batched cuDNN groups) at 64K-1M; decode with 2 vs 3 pipeline stages.
cp scratch/gguf.part00 /tmp/part00
python3 -m pip install -q --no-index --no-deps --target /tmp/site scratch/whl/*.whl
mkdir -p /tmp/r; R=/tmp/r
export PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
export CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/ops/test_focus_sdpa.py \
    tests/ops/test_focus_triton.py > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/pytest_cuda.txt | tail -30
timeout 260 python3 -m sieve_attn.cli bench focus --backend triton --backends sdpa --lengths 64K,256K,1M --groups 8,16 \
    --top-k 1 --backward --max-backward-length 256K --decode-lengths '' --baselines cudnn,prototype --reps 5 \
    --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $R/bench_hybrid > $R/bench_hybrid.txt 2>&1
tail -30 $R/bench_hybrid.txt
for stages in 3 2; do
  timeout 40 python3 -c "import sys, sieve_attn.ops.focus.decode as d; d._NUM_STAGES = $stages; \
from sieve_attn.cli import main; sys.exit(main(sys.argv[1:]))" bench focus --lengths '' --groups 8 --top-k 1,2 \
      --decode-lengths 32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $R/decode_stages$stages \
      > $R/decode_stages$stages.txt 2>&1
  echo "stages $stages"; tail -6 $R/decode_stages$stages.txt
done
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
