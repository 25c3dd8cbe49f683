#!/bin/bash
# Session 42, call A (named nvidia-h200): the SFA decode pool's knobs swept on the H200 (session 36 tuned the
# shrinking units on an H100 only), 128K, D = 128, GQA 32/8, gated, 5 interleaved rounds; the best (pick_knobs.py)
# set in the device copy; then the gated `sieve bench sfa` decode rows twice, each its own process. VARIANTS,
# PROBE_SECONDS and BENCH_RUNS override the sweep, its time limit and the bench's runs (call_b.sh).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
S=benchmarks/results/session42
VARIANTS=${VARIANTS:-'decode,decode:_POOLED=0.2,decode:_POOLED=0.3,decode:_UNIT_TILES=8;_POOLED=0.2,_decode_pps7,_decode_pps7:_POOLED=0.2'}
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200"; exit 3; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
cp sieve_attn/ops/sfa/decode.py sieve_attn/ops/sfa/_decode_pps7.py
echo 'def _programs_per_sm(head_dim): return 7' >> sieve_attn/ops/sfa/_decode_pps7.py
timeout ${PROBE_SECONDS:-300} python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 5 \
    --variants "$VARIANTS" \
    --out $OUT/probe > $OUT/probe.txt 2>&1
echo "probe exit $?" >> $OUT/probe.txt; grep '"ms"\|FAIL\|exit\|Error' $OUT/probe.txt | cut -c1-200
python3 $S/pick_knobs.py $OUT/probe/decode_probe.json | tee $OUT/pick.txt
for run in $(seq ${BENCH_RUNS:-2}); do
  timeout 80 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench$run > /tmp/bench$run.txt 2>&1
  echo "bench exit $?" >> /tmp/bench$run.txt; grep "^| decode\|exit" /tmp/bench$run.txt
  cat /tmp/bench$run.txt >> $OUT/bench_runs.txt
done
cp /tmp/bench$run/bench_sfa.json $OUT/ 2>/dev/null
