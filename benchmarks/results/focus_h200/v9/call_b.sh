# Device call (session 13, focus v9 B): CUDA tests of both decode kernels and their benches with the new plans
# (Focus 6 programs per SM), then the gated Focus decode bench at 8K-128K, K=8, top-1 and top-2.
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pytest -q tests/ops/test_focus_decode.py tests/ops/test_sfa_cache.py tests/test_bench_focus.py \
  tests/test_bench_sfa.py 2>&1 | tee $OUT/pytest_cuda_stdout.txt | tail -2
mkdir -p $OUT/bench
python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --decode-lengths 8K,32K,128K --reps 10 \
  --skip-nan-checks --cuda-graphs --out $OUT/bench 2>&1 | tee $OUT/bench_focus_decode_stdout.txt | tail -12
