#!/bin/bash
# Call D (session 26): the pool (programs take over keys from each other, `_sfa_decode_chunk`): pool_probe.py sweeps
# the pooled fraction and the unit (plans POOLED:UNIT:STAGES:PROGRAMS_PER_SM; 0 = fixed chunks, the kernel before),
# gated, timed hot in 5 interleaved rounds beside dense SDPA-cuDNN, at D=128 and D=64; then program_times.py at the
# fixed chunks and at one pooled plan, to see the SMs' end times come together.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=benchmarks/results/sfa_h200/v10
timeout 240 python3 $D/pool_probe.py $OUT 0:4:5:8,0.1:4:5:8,0.15:4:5:8,0.2:4:5:8,0.3:4:5:8,0.15:2:5:8,0.15:8:5:8,0.2:4:5:7 \
    > $OUT/pool_probe_stdout.txt 2>&1
echo "exit $?" >> $OUT/pool_probe_stdout.txt
PROBE_DIM=64 timeout 150 python3 $D/pool_probe.py $OUT 0:4:5:10,0.1:4:5:10,0.2:4:5:10,0.3:4:5:10 \
    >> $OUT/pool_probe_stdout.txt 2>&1
echo "exit $?" >> $OUT/pool_probe_stdout.txt; grep "rounds\|exit" $OUT/pool_probe_stdout.txt | cut -c1-240
grep "FAIL" $OUT/pool_probe_stdout.txt | cut -c1-300
PROBE_PLAN=0:4:5:8 PROBE_TAG=_fixed timeout 60 python3 $D/program_times.py $OUT > $OUT/program_times_stdout.txt 2>&1
PROBE_PLAN=0.2:4:5:8 PROBE_TAG=_pooled timeout 60 python3 $D/program_times.py $OUT >> $OUT/program_times_stdout.txt 2>&1
echo "exit $?" >> $OUT/program_times_stdout.txt; cut -c1-600 $OUT/program_times_stdout.txt | grep -v Warn | tail -n 12
