#!/bin/bash
# Session 47, call B (named nvidia-h200): the SFA decode pool at 5% from topk = 16 (decode.py's _pool_fraction,
# chosen from this session's calls 2 and 3) against the former 10% and two more knobs, probed at 128K
# (D = 128, GQA 32/8, gated, 5 interleaved rounds); the gated `sieve bench sfa` decode rows twice, each its own
# process. Exits at once on a card other than an H200 (call 5 ran the CUDA tests and the probe on an H100).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200"; exit 3; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
timeout 200 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 5 \
    --variants 'decode,decode:_POOLED_TOPK16=0.1,decode:_PREFETCH_TILES=1,decode:_NUM_STAGES=6' \
    --out $OUT/probe > $OUT/probe.txt 2>&1
echo "probe exit $?" >> $OUT/probe.txt
python3 - $OUT/probe/decode_probe.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(r["T"], r["topk"], r["variant"], "%.5f" % r["ms"] if "ms" in r else r)
PY
for run in 1 2; do
  timeout 150 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench$run > $OUT/bench_run$run.txt 2>&1
  echo "bench exit $?" >> $OUT/bench_run$run.txt; grep "^| decode\|exit" $OUT/bench_run$run.txt
  cp /tmp/bench$run/bench_sfa.json $OUT/bench_sfa_run$run.json 2>/dev/null
done
