#!/bin/bash
# Session 38, call A, after the review fixes (5c8351e). On an H200 (issue 4's card) first the gated decode rows of
# `sieve bench sfa` at 128K, D = 128, k = 8 and 16. On any card: the CUDA tests of what the fixes touched (lse
# gradients of the Triton backends and the sdpa backend's refusal, the Focus decode kernel refused under autograd,
# MQA caches of odd byte counts, FlashSFA, Focus's Triton and sdpa backends, the argument checks, beam search with
# Focus, the benches), then `sieve bench focus --backward` at 16K and 64K, whose gradient gate now runs, at 4K, the
# backend the timed length resolves to.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_a; mkdir -p $R
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $R/h200_bench > $R/h200_bench.txt 2>&1
  echo "bench exit $?" >> $R/h200_bench.txt; grep "^| decode\|exit" $R/h200_bench.txt
fi
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/ops/test_lse_gradients.py tests/ops/test_checks.py \
    tests/ops/test_sfa_cache.py tests/ops/test_flash_sfa.py tests/ops/test_focus_triton.py tests/ops/test_focus_sdpa.py \
    tests/ops/test_focus_decode.py tests/ops/test_sfa_reference.py tests/test_bench_focus.py tests/test_bench_sfa.py \
    tests/integrations/test_sfa_compose.py "tests/integrations/test_transformers.py::test_beam_search_routes_each_beam_with_its_own_groups" \
    > $R/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $R/pytest_cuda.txt; tail -n 3 $R/pytest_cuda.txt
timeout 150 python3 -m sieve_attn.cli bench focus --lengths 16K,64K --head-dims 128 --groups 8 --top-k 1,2 \
    --backward --decode-lengths '' --out $R/bench_focus > $R/bench_focus.txt 2>&1
echo "bench focus exit $?" >> $R/bench_focus.txt; cat $R/bench_focus.txt | tail -n 12
tar czf $OUT/call_a.tgz -C /tmp/r call_a
