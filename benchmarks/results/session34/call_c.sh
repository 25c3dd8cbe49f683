#!/bin/bash
# Session 34, call C (an H100 came, as for calls A and B: cuda_tests/call_a.sh, decode_batch/call_a.sh):
# (1) the GPU tests call A failed, with tests/conftest.py's poison now filled under no_grad (torch 2.11 allocates
# requires-grad leaves through torch.empty in checkpoint and in torch.compile), and the integration tests on the
# GPU under the poison, and the decode tests with split_k.plan in whole waves; (2) decode at batch 1, 4 and 8 on one card (call B had batch 4 and 8 only), 32K and 128K, both kernels with
# split_k.plan in whole waves (decode) beside the plan before it (_decode_cdiv, a copy of decode.py importing
# HEAD's split_k as _split_k_cdiv): at batch 1 the two plans are the same (a noise check), at 4 and 8 they differ.
# The copies, made on the CPU machine before the call and removed after it (untracked, they travel with the tree):
#   git show 008f7c7:sieve_attn/ops/split_k.py > sieve_attn/ops/_split_k_cdiv.py
#   for k in sfa focus; do sed 's/^from \.\. import split_k$/from .. import _split_k_cdiv as split_k/' \
#       sieve_attn/ops/$k/decode.py > sieve_attn/ops/$k/_decode_cdiv.py; done
set -u
# At most 8 files come back: each stage writes under /tmp/r/STAGE and is packed into $OUT/STAGE.tgz at once.
pack() { tar czf $OUT/$1.tgz -C /tmp/r $1; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $OUT/versions.txt
sha256sum tests/conftest.py sieve_attn/ops/*.py sieve_attn/ops/*/*.py > $OUT/digests.txt
T=tests/ops R=/tmp/r/tests; mkdir -p $R /tmp/r/probes /tmp/r/bench
( timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short $T/test_sfa_reference.py $T/test_focus_flex.py \
    $T/test_causality.py $T/test_focus_reference.py > $R/pytest_ops_rerun.txt 2>&1; echo "pytest exit $?" >> $R/pytest_ops_rerun.txt ) &
( timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/integrations > $R/pytest_integrations.txt 2>&1
  echo "pytest exit $?" >> $R/pytest_integrations.txt ) &
( timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short $T/test_sfa_cache.py $T/test_focus_decode.py \
    $T/test_split_k.py $T/test_merge.py > $R/pytest_decode_plan.txt 2>&1; echo "pytest exit $?" >> $R/pytest_decode_plan.txt ) &
wait
for f in $R/pytest_*.txt; do echo "== $f"; grep -E "passed|failed|^FAILED|ERROR|exit" $f | tail -8; done; pack tests
for batch in 1 4 8; do
  for kernel in focus sfa; do
    topk=16,8; [ $kernel = focus ] && topk=1,2
    timeout 60 python3 benchmarks/decode_probe.py --kernel $kernel --topk $topk --batch $batch --lengths 32K,128K \
        --rounds 5 --out /tmp/r/probes/${kernel}_b$batch --variants decode,_decode_cdiv > /tmp/r/probes/${kernel}_b$batch.txt 2>&1
    echo "probe exit $?" >> /tmp/r/probes/${kernel}_b$batch.txt; grep 'FAIL\|exit' /tmp/r/probes/${kernel}_b$batch.txt
  done
done
python3 - <<'PY'
import json, glob, os
for path in sorted(glob.glob("/tmp/r/probes/*_b*/decode_probe.json")):
    d = json.load(open(path))
    print(d["kernel"], "batch", d["batch"], " ".join(f'{r["T"]}/{r["topk"]}/{r["variant"]}={r["ms"]:.4f}'
                                                     for r in d["rows"] if "ms" in r))
PY
pack probes
