#!/bin/bash
# v17 call R (written in session 20; ran in session 21, outputs in call_r/): the Triton kernels' query tiles
# longest first (Tiling.longest_first).
# CUDA tests of the Triton kernels, the probe of both orders, then the gated 8K-64K top-1 bench as CUDA graphs with
# the committed order. If launch order wins, set longest_first=False in triton_prefill.tiling and record it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x tests/ops/test_focus_triton.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -2 $OUT/pytest_cuda_stdout.txt
timeout 200 python3 benchmarks/results/focus_h200/v17/probe_longest_first.py $OUT > $OUT/probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_stdout.txt; cat $OUT/probe_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 8K,16K,64K --groups 8,16 --top-k 1 --backend triton \
    --baselines cudnn --decode-lengths '' --reps 10 --budget 0.5 --max-call-seconds 6 --skip-nan-checks \
    --cuda-graphs --out $OUT/graphs > $OUT/graphs_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/graphs_stdout.txt; tail -8 $OUT/graphs_stdout.txt
rm -f $OUT/*/*.png  # 7 files come back
# Then the decode plans v16 left untimed (see the probe's docstring).
timeout 240 python3 benchmarks/results/focus_h200/v17/probe_decode_plan2.py $OUT > $OUT/decode_probe_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/decode_probe_stdout.txt; cut -c1-200 $OUT/decode_probe_stdout.txt
