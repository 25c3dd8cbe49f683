#!/bin/bash
# Call C (session 26): 1. warm_probe.py: is a decode step slower after the GPU sat idle (as during a compile)?
# 2. program_times.py: each SFA decode program's start, wait and end, per SM; 3. gather_probe.py: the tree (L1
# table gathers, _table_entries) against the staged gathers, plans swept, gated, timed hot in 5 interleaved rounds
# beside dense SDPA-cuDNN, D=128 and D=64. The tree when this ran: f4c1754 plus l1_gather.diff (the L1 gathers;
# its plan 4 stages, 7 programs per SM at D=128); the diff was reverted after this call (slower at D=128).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=benchmarks/results/sfa_h200/v10
timeout 200 python3 $D/warm_probe.py $OUT > $OUT/warm_probe_stdout.txt 2>&1
echo "exit $?" >> $OUT/warm_probe_stdout.txt; tail -n 22 $OUT/warm_probe_stdout.txt
timeout 60 python3 $D/program_times.py $OUT > $OUT/program_times_stdout.txt 2>&1
echo "exit $?" >> $OUT/program_times_stdout.txt; cut -c1-700 $OUT/program_times_stdout.txt | tail -n 6
timeout 200 python3 $D/gather_probe.py $OUT > $OUT/gather_probe_stdout.txt 2>&1
echo "exit $?" >> $OUT/gather_probe_stdout.txt
PROBE_DIM=64 timeout 150 python3 $D/gather_probe.py $OUT staged:5:10,tree:3:10,tree:3:12,tree:4:8,tree:4:10,tree:5:8 \
    >> $OUT/gather_probe_stdout.txt 2>&1
echo "exit $?" >> $OUT/gather_probe_stdout.txt; grep "rounds\|exit" $OUT/gather_probe_stdout.txt | cut -c1-250
grep -c FAIL $OUT/gather_probe_stdout.txt
