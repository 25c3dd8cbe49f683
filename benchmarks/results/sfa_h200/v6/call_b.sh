# Device call B (session 13): the decode probe over tiles, warps, stages and programs per SM (stages 1 = no software
# pipelining), then the CUDA tests of the SFA cache/decode with the committed default and with the probe's best.
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.:benchmarks/results/sfa_h200/v6
export VARIANTS="32/1/1/16 32/1/1/64 64/2/1/16 64/2/1/32 64/1/1/32 128/4/1/8 128/4/1/16 32/1/3/16 32/1/2/16 32/1/3/12 32/1/2/32 64/2/3/8 64/1/3/16 64/1/2/16"
python3 benchmarks/results/sfa_h200/v6/decode_probe.py $OUT 128 2>&1 | tee $OUT/decode_probe_stdout.txt | grep -E "dense|v4|best|fail"
python3 -m pytest -q tests/ops/test_sfa_cache.py 2>&1 | tee $OUT/pytest_default_stdout.txt | tail -3
cat $OUT/best.json; SFA_DECODE_CONFIG=$OUT/best.json python3 -m pytest -q -p pin_config tests/ops/test_sfa_cache.py 2>&1 | tee $OUT/pytest_best_stdout.txt | tail -3
