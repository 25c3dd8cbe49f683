# Device call D (session 13): call C's script over programs per SM around the new default (32 keys, 1 warp, 3 stages,
# 8 programs per SM), then the CUDA tests of the SFA cache, decode and bench with the committed default.
VARIANTS="32/1/3/4 32/1/3/6 32/1/3/10 32/1/3/12 32/1/2/8 32/1/3/8" bash benchmarks/results/sfa_h200/v6/call_c.sh &&
  python3 -m pytest -q tests/ops/test_sfa_cache.py tests/test_bench_sfa.py 2>&1 | tee $OUT/pytest_default_stdout.txt | tail -2
