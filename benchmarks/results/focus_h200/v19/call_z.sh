#!/bin/bash
# v19 call Z (session 22): the final code. Clocks and power logged beside everything (nvidia-smi every 100 ms);
# traces of queued 64K forwards, v18's code and v19's (where the device idles); v18 against v19 at 16K and 32K,
# K=8 (top-2 takes the sdpa backend there, where the host's launches weigh more); the headline rows on v19
# (64K forward and forward+backward, 256K and 1M forward, K=8 and 16, top-1 and top-2); then the CUDA tests call Y
# left unrun (the flex backend's, the bench's).
export PYTHONUNBUFFERED=1
NEW=$PWD OLD=$PWD/scratch/v18
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 100 > $OUT/smi.csv 2>&1 &
SMI=$!
for code in old new; do
  dir=$NEW; [ $code = old ] && dir=$OLD
  PYTHONPATH=$dir timeout 60 python3 benchmarks/results/focus_h200/v19/trace_calls.py $code > $OUT/trace_${code}_stdout.txt 2>&1
  grep -v Warn $OUT/trace_${code}_stdout.txt | tail -2
done
mkdir -p $OUT/ab
for code in old new old new; do
  dir=$NEW; [ $code = old ] && dir=$OLD
  n=$(ls $OUT/ab | grep -c "^$code") 
  PYTHONPATH=$dir timeout 90 python3 -m sieve_attn.cli bench focus --lengths 16K,32K --groups 8 --top-k 1,2 \
      --baselines cudnn --decode-lengths '' --reps 10 --budget 1.0 --max-call-seconds 6 --skip-nan-checks \
      --out $OUT/ab/$code$n > $OUT/ab/${code}${n}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/ab/${code}${n}_stdout.txt; echo "== $code $n"; grep "| forward" $OUT/ab/${code}${n}_stdout.txt | tail -4
done
PYTHONPATH=$NEW timeout 150 python3 -m sieve_attn.cli bench focus --lengths 64K --groups 8,16 --top-k 1,2 \
    --baselines cudnn --backward --max-backward-length 64K --decode-lengths '' --reps 5 --budget 0.5 \
    --max-call-seconds 6 --skip-nan-checks --out $OUT/bench > $OUT/bench_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_stdout.txt; tail -10 $OUT/bench_stdout.txt
PYTHONPATH=$NEW timeout 200 python3 -m sieve_attn.cli bench focus --lengths 256K,1M --groups 8,16 --top-k 1,2 \
    --baselines cudnn --decode-lengths '' --reps 3 --budget 0.5 --max-call-seconds 20 --skip-nan-checks \
    --out $OUT/bench_long > $OUT/bench_long_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/bench_long_stdout.txt; tail -10 $OUT/bench_long_stdout.txt
kill $SMI
left=$((570 - SECONDS)); [ $left -gt 30 ] && PYTHONPATH=$NEW timeout $left python3 -m pytest -q \
    tests/test_bench_focus.py tests/ops/test_focus_flex.py -p no:cacheprovider > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $? after $SECONDS s" >> $OUT/pytest_cuda_stdout.txt; tail -3 $OUT/pytest_cuda_stdout.txt
rm -f $OUT/*/*.png $OUT/ab/*/*.png
cd $OUT && tar czf call_z.tgz --remove-files smi.csv trace_* ab bench bench_stdout.txt bench_long \
    bench_long_stdout.txt pytest_cuda_stdout.txt && ls -la $OUT
