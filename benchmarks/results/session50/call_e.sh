#!/bin/bash
# Session 50, call E (any H100 or H200; not run in session 50, no machine came back): 12 programs an SM wanted at
# D = 64 (call B's probe: 0.8% faster at 128K, batch 1, topk 8 and 16, every round) against the committed 10, now
# at 8K and 32K and at batch 4 too; then the gated bench rows at D = 64 as committed, for comparison.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
probe() {  # NAME TIMEOUT ARGS...
    local name=$1 limit=$2; shift 2
    timeout $limit python3 benchmarks/decode_probe.py --kernel sfa --rounds 5 --out $OUT/$name --head-dim 64 \
        --topk 8,16 --variants 'decode,decode:_PROGRAMS_PER_SM_NARROW=12' "$@" > $OUT/$name.txt 2>&1
    echo "$name exit $?" >> $OUT/$name.txt; grep "exit\|FAIL" $OUT/$name.txt
    grep -o '"variant": "[^"]*", "T": [0-9]*, "topk": [0-9]*, "D": [0-9]*, "rounds": \[[^]]*\], "ms": [0-9.]*, "x_dense": [0-9.]*' \
        $OUT/$name.txt | sed 's/"rounds": \[[^]]*\], //'
}
probe batch1 120 --lengths 8K,32K
probe batch4 100 --lengths 128K --batch 4
timeout 120 python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64 --topk 8,16 \
    --decode-lengths 8K,32K,128K --reps 10 --cuda-graphs --skip-nan-checks --out /tmp/bench_d64 > $OUT/bench.txt 2>&1
echo "bench exit $?" >> $OUT/bench.txt; grep "^| decode\|exit" $OUT/bench.txt
cp /tmp/bench_d64/bench_sfa.json /tmp/bench_d64/*.png $OUT/ 2>/dev/null
