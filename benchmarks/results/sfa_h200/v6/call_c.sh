# Device call C (session 13): a few more decode plans around the default (32 keys, 1 warp, 3 stages, 16 programs
# per SM), the CUDA tests with the probe's best, and the gated decode bench of the committed default.
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.:benchmarks/results/sfa_h200/v6
export VARIANTS="${VARIANTS:-32/2/3/16 32/1/3/8 32/1/4/16 32/1/3/20 16/1/3/16 32/1/3/24}"
python3 benchmarks/results/sfa_h200/v6/decode_probe.py $OUT 128 2>&1 | tee $OUT/decode_probe_stdout.txt | grep -E "dense|v4|v6|best|fail" | sed 's/{.*//'
cat $OUT/best.json; SFA_DECODE_CONFIG=$OUT/best.json python3 -m pytest -q -p pin_config tests/ops/test_sfa_cache.py 2>&1 | tee $OUT/pytest_best_stdout.txt | tail -2
mkdir -p $OUT/bench
python3 -m sieve_attn.cli bench sfa --lengths '' --head-dims 64,128 --topk 8,16 --decode-lengths 8K,32K,128K --reps 10 \
  --skip-nan-checks --cuda-graphs --out $OUT/bench 2>&1 | tee $OUT/bench_sfa_decode_stdout.txt | tail -20
ls $OUT/bench
