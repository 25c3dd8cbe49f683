#!/bin/bash
# Session 50, call B (at once after call A, on the same warm machine): the same gated bench rows at D = 64 (plan 10
# programs an SM; the kernel holds 11 / 9 / 8 at topk 16 / 20 / 24), then three probes, each against the committed
# step in interleaved rounds:
# - 4 pipeline stages at topk 20 and 24, D = 128 (compiled for sm_90: 15.5 / 16.9 KiB of shared memory against
#   30.7 / 33.6 with 5, so 8 programs fit again; 4 stages were 5-15% slower than 5 at topk 16, v9);
# - 12 programs an SM wanted at D = 64 (topk 8 holds 15, so gets 12; topk 16 holds 11): v9's 12 ran 11 at topk 16,
#   and the programs past them made it slower, while topk 8 was faster (0.062 against 0.064 ms);
# - 9 programs an SM wanted at D = 128 (topk 8 holds 9; topk 16 stays at 8, a control).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 200 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64 --topk 16,20,24 \
    --decode-lengths 32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_k64 > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_k64/bench_sfa.json /tmp/bench_k64/*.png $OUT/ 2>/dev/null
probe() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2; shift 2
    timeout $limit python3 benchmarks/decode_probe.py --kernel sfa --lengths 128K --rounds 5 --out $OUT/$name "$@" \
        > $OUT/$name.txt 2>&1
    echo "$name exit $?" >> $OUT/$name.txt; grep "exit\|FAIL" $OUT/$name.txt
    grep -o '"variant": "[^"]*", "T": [0-9]*, "topk": [0-9]*, "D": [0-9]*, "rounds": \[[^]]*\], "ms": [0-9.]*, "x_dense": [0-9.]*' \
        $OUT/$name.txt | sed 's/"rounds": \[[^]]*\], //'
}
probe stages 170 --topk 20,24 --variants 'decode,decode:_NUM_STAGES=4'
probe narrow 100 --topk 8,16 --head-dim 64 --variants 'decode,decode:_PROGRAMS_PER_SM_NARROW=12'
probe wide 80 --topk 8,16 --variants 'decode,decode:_PROGRAMS_PER_SM_WIDE=9'
