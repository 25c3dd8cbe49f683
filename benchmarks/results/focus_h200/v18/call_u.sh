#!/bin/bash
# v18 call U (session 21): masked dense decode against the Triton decode kernel on 1K-32K caches
# (probe_masked_decode.py), then Nsight Compute on one decode launch at 128K, D=128, top-2 (ncu_decode.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/results/focus_h200/v18/probe_masked_decode.py $OUT > $OUT/masked_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/masked_stdout.txt; cut -c1-330 $OUT/masked_stdout.txt
timeout 150 ncu --clock-control none --kernel-name regex:_focus_decode_chunk --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/results/focus_h200/v18/ncu_decode.py > $OUT/ncu_decode.txt 2>&1
echo "ncu exit $?" >> $OUT/ncu_decode.txt; tail -80 $OUT/ncu_decode.txt
