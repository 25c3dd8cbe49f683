#!/bin/bash
# Call A (session 31): both decode kernels (Focus K = 8 top-1/top-2, SFA k = 16/8) at batch 4 and 8 beside dense
# SDPA-cuDNN decode over the same caches, 32K and 128K cached tokens, GQA 32/8, D = 128, bf16; gated against
# float64, CUDA graphs, 5 interleaved rounds (benchmarks/decode_probe.py --batch, new). Focus also with v24's list
# kernel (../focus_h200/v24/list_kernel.patch, reverted at batch 1), which scans each chunk once for all KV heads:
# at batch 4 and 8 the H200 plan has 5 and 10 waves, each of which pays the committed kernel's scan again.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# Before the call, on the CPU machine (the copy travels with the working tree, untracked; remove it after):
#   python3 -c "import pathlib; t = pathlib.Path('benchmarks/results/focus_h200/v24/list_kernel.patch').read_text();
#   pathlib.Path('/tmp/decode_part.patch').write_text(t[:t.index('diff --git a/tests/')])"
#   patch -o sieve_attn/ops/focus/_decode_v24.py sieve_attn/ops/focus/decode.py < /tmp/decode_part.patch
[ -f sieve_attn/ops/focus/_decode_v24.py ] || { echo "sieve_attn/ops/focus/_decode_v24.py missing"; exit 1; }
sha256sum sieve_attn/ops/focus/*decode*.py sieve_attn/ops/sfa/decode.py sieve_attn/ops/split_k.py \
    sieve_attn/ops/triton_common.py benchmarks/decode_probe.py > $OUT/digests.txt
for batch in 4 8; do
  for kernel in focus sfa; do
    topk=16,8; variants=decode; [ $kernel = focus ] && topk=1,2 && variants=decode,_decode_v24
    timeout 140 python3 benchmarks/decode_probe.py --kernel $kernel --topk $topk --batch $batch --lengths 32K,128K \
        --rounds 5 --out $OUT/${kernel}_b$batch --variants $variants > /tmp/${kernel}_b$batch.txt 2>&1
    echo "probe exit $?" >> /tmp/${kernel}_b$batch.txt
    echo "== $kernel batch $batch"; grep 'FAIL\|exit\|Error' /tmp/${kernel}_b$batch.txt
  done
done > $OUT/probe_stdout_summary.txt
cat /tmp/*_b*.txt > $OUT/probe_stdout.txt
cat $OUT/probe_stdout_summary.txt
python3 - <<'PY'
import json, glob, os
for path in sorted(glob.glob(os.environ["OUT"] + "/*_b*/decode_probe.json")):
    d = json.load(open(path))
    for r in d["rows"]:
        if "ms" in r:
            print(d["kernel"], "batch", d["batch"], r["T"], r["topk"], r["variant"], round(r["ms"], 4), round(r["x_dense"], 3))
PY
