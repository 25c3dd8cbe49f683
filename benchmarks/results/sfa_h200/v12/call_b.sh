#!/bin/bash
# Call B (session 28): an L2 prefetch inside the key loop, LOOKAHEAD tiles ahead of each tile (decode._LOOKAHEAD_TILES),
# side by side with f66370d's step (its decode.py carried as scratch/_decode_f66370d.py), at 128K, 64K and 32K.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cp scratch/_decode_f66370d.py sieve_attn/ops/sfa/
L=decode:_LOOKAHEAD_TILES
V=_decode_f66370d,$L=0,$L=2,$L=4,$L=8,$L=16
timeout 400 python3 benchmarks/decode_probe.py --out $OUT --variants $V --lengths 128K,64K,32K > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt
python3 - $OUT/decode_probe.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["T"], r["topk"], r["variant"], f'{r["ms"]:.4f} {r["x_dense"]:.3f}' if "ms" in r else ("ok" if r.get("ok") else f"FAIL {r}"))
PY
tail -n 1 $OUT/probe_stdout.txt
