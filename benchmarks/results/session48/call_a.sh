#!/bin/bash
# Session 48, call A (named nvidia-h200): the gated `sieve bench sfa` decode rows at 128K twice (issue 4's figure;
# each its own process), then a probe (D = 128, GQA 32/8, gated, 5 interleaved rounds, SFA topk 16 and 8) of the
# one-pass merge of the split-K partials (split_k._merge_kernel: each step loads its log-sum-exps and outputs
# together, one memory round trip instead of two) against session 47's merge (scratch/_split_k_v47.py, carried:
# `git show 1ea3658:sieve_attn/ops/split_k.py`; an SFA decode module importing it is made here). Exits on a card
# other than an H200. Call A' (an H100) ran the probe without the benches, then the GPU tests of the merge and of
# Focus decode, which shares it:
#   python3 -m pytest tests/ops/test_split_k.py::test_merge_matches_float64_with_empty_and_extreme_chunks \
#       tests/ops/test_focus_decode.py -q -x -p no:cacheprovider
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200"; exit 3; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
for run in 1 2; do
  timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench$run > $OUT/bench_run$run.txt 2>&1
  echo "bench exit $?" >> $OUT/bench_run$run.txt; grep "^| decode\|exit" $OUT/bench_run$run.txt
  cp /tmp/bench$run/bench_sfa.json $OUT/bench_sfa_run$run.json 2>/dev/null
done
# The session-47 merge beside the new one (files made on the device only; never committed).
cp scratch/_split_k_v47.py sieve_attn/ops/_split_k_v47.py
sed 's/^from \.\. import split_k$/from .. import _split_k_v47 as split_k/' sieve_attn/ops/sfa/decode.py > sieve_attn/ops/sfa/_decode_v47.py
grep -c "_split_k_v47" sieve_attn/ops/sfa/_decode_v47.py | sed 's/^/v47 module imports the old merge: /' | tee $OUT/probe.txt
timeout 220 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 5 \
    --variants 'decode,_decode_v47,decode:_POOLED_TOPK16=0.1' --out $OUT/probe >> $OUT/probe.txt 2>&1
echo "probe exit $?" >> $OUT/probe.txt
python3 - $OUT/probe/decode_probe.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(r["T"], r["topk"], r["variant"], "%.5f" % r["ms"] if "ms" in r else r)
PY
rm sieve_attn/ops/_split_k_v47.py sieve_attn/ops/sfa/_decode_v47.py
