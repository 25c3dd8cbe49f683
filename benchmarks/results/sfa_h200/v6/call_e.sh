# Device call E (session 13): key values read as 8-byte words (staged by the pipeline with V) against v6's plain
# value loads, over a few plans; CUDA tests with the probe's best and the default; the gated decode bench.
VARIANTS="32/1/2/8 32/1/4/8 32/1/3/6 32/1/3/16 64/2/3/4 64/2/3/8 128/4/3/2 128/4/3/4" \
  bash benchmarks/results/sfa_h200/v6/call_c.sh &&
  python3 -m pytest -q tests/ops/test_sfa_cache.py tests/test_bench_sfa.py 2>&1 | tee $OUT/pytest_default_stdout.txt | tail -2
