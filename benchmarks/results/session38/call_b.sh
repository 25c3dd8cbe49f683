#!/bin/bash
# Session 38, call B: what call A's time limits cut (its pytest stopped in tests/ops/test_focus_decode.py after
# ~395 passed, its bench before its first row, Triton compiling on a cold cache): the rest of the CUDA tests, then
# `sieve bench focus --backward` at 64K, K = 8, top-1, whose gradient gate now runs the timed length's backend.
# Everything writes under $OUT as it goes (a cut call keeps what ran).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_focus_decode.py tests/test_bench_focus.py \
    tests/test_bench_sfa.py tests/integrations/test_sfa_compose.py \
    "tests/integrations/test_transformers.py::test_beam_search_routes_each_beam_with_its_own_groups" \
    > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt; tail -n 3 $OUT/pytest_cuda.txt
timeout 230 python3 -m sieve_attn.cli bench focus --lengths 64K --head-dims 128 --groups 8 --top-k 1 --backward \
    --decode-lengths '' --out $OUT/bench_focus > $OUT/bench_focus.txt 2>&1
echo "bench focus exit $?" >> $OUT/bench_focus.txt; tail -n 6 $OUT/bench_focus.txt
