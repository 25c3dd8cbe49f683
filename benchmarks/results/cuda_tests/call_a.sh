#!/bin/bash
# Session 33, call A: the whole of tests/ops on the H200 (the kernels at their GPU sizes, compiled, not interpreted),
# with the autouse poisoned allocations of tests/conftest.py (session 32) that had only run in the CPU interpreter.
# Four pytest processes over disjoint file groups share the GPU, because Triton's compile is CPU-bound.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
sha256sum sieve_attn/ops/*.py sieve_attn/ops/*/*.py tests/conftest.py > $OUT/digests.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/versions.txt
run_group() {
  local name=$1; shift
  timeout 540 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short --durations=8 "$@" > $OUT/pytest_$name.txt 2>&1
  echo "pytest exit $?" >> $OUT/pytest_$name.txt
}
T=tests/ops
run_group a $T/test_focus_triton.py $T/test_focus_groups.py $T/test_merge.py $T/test_gather.py $T/test_memory.py &
run_group b $T/test_flash_sfa.py $T/test_sfa_sdpa.py $T/test_magnitude.py $T/test_sfa_reference.py &
run_group c $T/test_sfa_cache.py $T/test_focus_decode.py &
run_group d $T/test_focus_sdpa.py $T/test_focus_flex.py $T/test_causality.py $T/test_routing.py $T/test_checks.py \
    $T/test_focus_reference.py &
wait
for f in $OUT/pytest_*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR|exit" $f | tail -12; done
