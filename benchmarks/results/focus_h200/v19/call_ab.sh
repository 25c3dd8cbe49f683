#!/bin/bash
# v19 call AB (session 22): v18 against v19 side by side, done right. Calls X-Z ran their "old" benches with
# `python3 -m` from the v19 checkout, which puts the current directory ahead of PYTHONPATH: both sides were v19 (the
# JSONs' source digests say so). Here each side runs from its own package's directory, and each run prints the
# digest of the code it timed (v18 = 55590a9's sieve_attn, sha256:06bf753d...). 32K and 64K, K=8, top-1 and top-2
# (32K top-2 and both 64K rows take the sdpa backend), three rounds in alternation.
export PYTHONUNBUFFERED=1
NEW=$PWD OLD=$PWD/scratch/v18
mkdir -p $OUT/ab
for round in 1 2 3; do
  for code in old new; do
    dir=$NEW; [ $code = old ] && dir=$OLD
    (cd $dir && timeout 90 python3 -m sieve_attn.cli bench focus --lengths 32K,64K --groups 8 --top-k 1,2 \
        --baselines cudnn --decode-lengths '' --reps 10 --budget 1.0 --max-call-seconds 6 --skip-nan-checks \
        --out $OUT/ab/$code$round) > $OUT/ab/${code}${round}_stdout.txt 2>&1
    python3 -c "
import json; d = json.load(open('$OUT/ab/$code$round/bench_focus.json'))
print('$code$round', d['environment']['source_digest'][:15], [(r['T'] // 1024, r['top_k'], r['focus_backend'],
      round(r['focus']['ms'], 3), round(r['baselines']['cudnn']['ms'], 3), round(r['speedup']['cudnn'], 3),
      r['gate']['passed']) for r in d['rows']])"
  done
done
rm -f $OUT/ab/*/*.png
cd $OUT && tar czf call_ab.tgz --remove-files ab && ls -la $OUT
