# Device call (session 13, focus v9 A): the Focus decode kernel's programs per SM against whole waves.
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 benchmarks/results/focus_h200/v9/decode_waves_probe.py $OUT 2>&1 | tee $OUT/decode_waves_probe_stdout.txt
