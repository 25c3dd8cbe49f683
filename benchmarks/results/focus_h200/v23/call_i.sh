#!/bin/bash
# Call I (session 30), on the committed Focus decode v23: per-program timers of a 128K step (program_times.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
sha256sum sieve_attn/ops/focus/decode.py > $OUT/digests.txt
timeout 200 python3 benchmarks/results/focus_h200/v23/program_times.py $OUT > $OUT/program_times_stdout.txt 2>&1
echo "exit $?" >> $OUT/program_times_stdout.txt; cat $OUT/program_times_stdout.txt | cut -c1-900 | tail -12
