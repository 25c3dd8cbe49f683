#!/bin/bash
# Call C (session 28): an L2 prefetch of each pool unit's keys when a program takes it (decode._PREFETCH_UNITS), with
# unit sizes, pool sizes and the pool at 64K, side by side with f66370d's step (scratch/_decode_f66370d.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cp scratch/_decode_f66370d.py sieve_attn/ops/sfa/
V=_decode_f66370d,decode:_PREFETCH_UNITS=0,decode,decode:_UNIT_TILES=2,decode:_UNIT_TILES=8,decode:_POOLED=0.2
V=$V,decode:_PREFETCH_TILES=3,decode:_POOL_FROM_TILES=16
timeout 400 python3 benchmarks/decode_probe.py --out $OUT --variants $V --lengths 128K,64K > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt
python3 - $OUT/decode_probe.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if "ms" in r or not r.get("ok"):
        print(r["T"], r["topk"], r["variant"], f'{r["ms"]:.4f} {r["x_dense"]:.3f}' if "ms" in r else f"FAIL {r}")
PY
tail -n 1 $OUT/probe_stdout.txt
