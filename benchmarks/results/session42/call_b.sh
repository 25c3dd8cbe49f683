#!/bin/bash
# Session 42, call B (named nvidia-h200): call A shortened for the device time left (four variants, 200 s of probe,
# one bench run).
VARIANTS='decode,decode:_POOLED=0.2,_decode_pps7,_decode_pps7:_POOLED=0.2' PROBE_SECONDS=200 BENCH_RUNS=1 \
    bash benchmarks/results/session42/call_a.sh
