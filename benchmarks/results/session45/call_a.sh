#!/bin/bash
# Session 45, call A (named nvidia-h200): on an H200, session 42's sweep of the decode pool's knobs and the gated
# decode bench (session42/call_a.sh); on any other card, the CUDA tests of tests/ops and tests/integrations on the
# current tree (last run on a GPU in session 39; sessions 40-44 changed argument checks, the backend tests and the
# CLI), five pytest processes over disjoint file groups, since Triton's compile is CPU-bound.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=3
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash benchmarks/results/session42/call_a.sh
fi
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
git rev-parse HEAD >> $OUT/versions.txt 2>/dev/null
run_group() {
  local name=$1; shift
  timeout ${TEST_SECONDS:-280} python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$@" > $OUT/pytest_$name.txt 2>&1
  echo "pytest exit $?" >> $OUT/pytest_$name.txt
}
T=tests/ops
run_group a $T/test_focus_triton.py $T/test_focus_groups.py $T/test_merge.py $T/test_gather.py $T/test_memory.py \
    $T/test_split_k.py &
run_group b $T/test_flash_sfa.py $T/test_sfa_sdpa.py $T/test_magnitude.py $T/test_sfa_reference.py \
    $T/test_lse_gradients.py &
run_group c $T/test_sfa_cache.py $T/test_focus_decode.py $T/test_kernels_compile.py $T/test_interpreter_fault.py &
run_group d $T/test_focus_sdpa.py $T/test_focus_flex.py $T/test_causality.py $T/test_routing.py $T/test_checks.py \
    $T/test_focus_reference.py &
run_group e tests/integrations --ignore=tests/integrations/test_smollm2.py &
wait
for f in $OUT/pytest_*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR|exit" $f | tail -8 | cut -c1-200; done
