#!/bin/bash
# Session 34, call G: why does the gated bench read SFA decode slower than the probe (call D's bench 0.142 ms at 128K,
# k = 16 on the H100, call C's probe 0.1256; on the H200 0.096-0.102 against 0.092, sessions 26-28)? The probe warms
# up 20 calls and times 50 per round; the bench warms up 3 (2 after its gate) and times 10. Hypothesis: a
# latency-bound step runs slower on a GPU whose clocks have not ramped up after the idle gaps of the bench's
# gates and captures, where cuDNN's bandwidth-bound step barely changes. Test: the same bench rows with the default
# warm-up, with 200 warm-up calls and 50 timed ones, and the default again, SFA and Focus decode, side by side.
set -u
mkdir -p /tmp/r/warm; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > /tmp/r/warm/versions.txt
run() {
  local name=$1; shift
  timeout 80 python3 -m sieve_attn.cli bench "$@" --cuda-graphs --skip-nan-checks --out /tmp/r/warm/$name \
      > /tmp/r/warm/$name.txt 2>&1; echo "bench exit $?" >> /tmp/r/warm/$name.txt
  echo "== $name"; grep "^| decode\|exit\|FAIL" /tmp/r/warm/$name.txt
}
SFA="sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K"
FOCUS="focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 32K,128K"
for round in 1 2; do
  eval run sfa_default_$round $SFA --reps 10
  eval run sfa_warm_$round $SFA --warmup 200 --reps 50
done
eval run focus_default $FOCUS --reps 10
eval run focus_warm $FOCUS --warmup 200 --reps 50
tar czf $OUT/warm.tgz -C /tmp/r warm
