#!/bin/bash
# Session 36, call A: SFA decode at 128K, D = 128, GQA 32/8 -- the committed step beside two candidate changes in
# scratch copies (sieve_attn/ops/sfa/_decode_try.py, sieve_attn/ops/_split_k_try.py): the merge loading the
# partial outputs beside their log-sum-exps (_TAPER=0), and the pool's units shrinking as it drains (_TAPER=1,
# from 4- or 8-tile units). On an H200 first the gated bench's decode rows (issue 4's card).
# The copies are not kept: the shrinking units are decode.py's since this session (pool_units), the merge's diff is
# call_a/merge_loads_together.patch.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
R=/tmp/r/call_a; mkdir -p $R
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 90 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $R/bench > $R/bench.txt 2>&1
  echo "bench exit $?" >> $R/bench.txt; grep "^| decode\|exit" $R/bench.txt
fi
timeout 300 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 128K --rounds 7 \
    --variants 'decode,_decode_try:_TAPER=0,_decode_try,_decode_try:_UNIT_TILES=8,_decode_try:_POOLED=0.2' \
    --out $R/probe > $R/probe.txt 2>&1
echo "probe exit $?" >> $R/probe.txt; tail -16 $R/probe.txt
tar czf $OUT/call_a.tgz -C /tmp/r call_a
