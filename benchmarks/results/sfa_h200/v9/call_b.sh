#!/bin/bash
# Call B (session 25): five packages side by side, each gated against float64, the plan swept (stages 3/4, 8/10/12
# programs per SM): scratch/head (the previous commit, its defaults), scratch/words (indices read as words),
# scratch/lanes (+ the softmax denominators in per-slot partial sums), scratch/table32 (+ a float32 query table),
# scratch/exp2 (+ softmax in base 2 with one-instruction exponentials; = the tree). Then the CUDA tests of the SFA cache, both decode kernels and SFA generation on the tree.
set -u
export PYTHONUNBUFFERED=1
P=benchmarks/results/sfa_h200/v9/index_words_probe.py
PYTHONPATH=$PWD/scratch/head PROBE_PLAN=defaults PROBE_FOCUS=1 timeout 100 python3 $P $OUT head > $OUT/probe_head.txt 2>&1
echo "exit $?" >> $OUT/probe_head.txt
for pkg in words lanes table32 exp2; do
  focus=$([ $pkg = lanes ] || [ $pkg = exp2 ] && echo 1)  # the packages whose Focus decode changed
  PROBE_FOCUS=$focus PYTHONPATH=$PWD/scratch/$pkg PROBE_PLAN=plan PROBE_STAGES=3,4 PROBE_PROGRAMS=8,10,12 timeout 150 python3 $P $OUT $pkg \
      > $OUT/probe_$pkg.txt 2>&1
  echo "exit $?" >> $OUT/probe_$pkg.txt
done
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_sfa_cache.py \
    tests/ops/test_focus_decode.py tests/integrations/test_sfa_cache.py > $OUT/pytest_cuda.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda.txt
grep -h "dense sdpa\|exit" $OUT/probe_*.txt
grep -h '"kernel": "focus"' $OUT/probe_*.txt | cut -c1-260
grep -h '"kernel": "sfa"' $OUT/probe_*.txt | python3 -c "
import json,sys
for l in sys.stdin:
    ok = not l.startswith('FAIL'); r = json.loads(l[5:] if not ok else l)
    print(r['tag'], r['D'], r['topk'], r.get('_NUM_STAGES'), r.get('_programs_per_sm'), 'ok' if ok else 'FAIL', round(r.get('err_ratio', -1), 2), round(r.get('ms', 0), 4), round(r.get('x_dense', 0), 3), r.get('error', ''))"
tail -n 3 $OUT/pytest_cuda.txt
