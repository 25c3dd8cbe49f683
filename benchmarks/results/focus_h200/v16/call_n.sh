#!/bin/bash
# v16 call N: the layout's segment bounds in one kernel and one fill for both slot buffers (CUDA tests, then the
# 8K layout's kernels in profile_share.py and 8K-16K top-1 as CUDA graphs beside every baseline); the decode scan
# in 512-key steps (CUDA tests, the gated decode bench); the decode plan at D=64 (probe_decode_plan.py 64);
# the host's issue rate of an 8K call as users and as composed models make it (host_profile.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x tests/ops/test_focus_triton.py tests/ops/test_focus_decode.py -p no:cacheprovider \
    > $OUT/pytest_cuda_stdout.txt 2>&1
echo "pytest exit $?" >> $OUT/pytest_cuda_stdout.txt; tail -2 $OUT/pytest_cuda_stdout.txt
python3 -m sieve_attn.cli bench focus --lengths 8K,16K --groups 8,16 --top-k 1 --backend triton \
    --baselines cudnn,flash,flex,prototype --decode-lengths '' --reps 10 --budget 0.5 --max-call-seconds 6 \
    --skip-nan-checks --cuda-graphs --out $OUT/graphs > $OUT/graphs_stdout.txt 2>&1
echo "bench exit $?" >> $OUT/graphs_stdout.txt; tail -6 $OUT/graphs_stdout.txt
for spread in combinations adjacent; do
  python3 -m sieve_attn.cli bench focus --lengths '' --groups 8 --top-k 1,2 --spread $spread \
      --decode-lengths 8K,32K,128K --reps 10 --skip-nan-checks --cuda-graphs --out $OUT/decode_$spread \
      > $OUT/decode_${spread}_stdout.txt 2>&1
  echo "bench exit $?" >> $OUT/decode_${spread}_stdout.txt; tail -4 $OUT/decode_${spread}_stdout.txt
done
timeout 150 python3 benchmarks/results/focus_h200/v16/probe_decode_plan.py $OUT 64 > $OUT/probe_d64_stdout.txt 2>&1
echo "probe exit $?" >> $OUT/probe_d64_stdout.txt; cut -c1-220 $OUT/probe_d64_stdout.txt
timeout 60 python3 benchmarks/results/focus_h200/v14/profile_share.py 65536 > $OUT/share_stdout.txt 2>&1
echo "profile exit $?" >> $OUT/share_stdout.txt; grep -v Warn $OUT/share_stdout.txt | cut -c1-400
timeout 60 python3 benchmarks/results/focus_h200/v16/host_profile.py $OUT > $OUT/host_stdout.txt 2>&1
echo "host profile exit $?" >> $OUT/host_stdout.txt; head -5 $OUT/host_stdout.txt; tail -1 $OUT/host_stdout.txt
rm -f $OUT/*/*.png
cd $OUT && tar czf call_n.tgz --exclude=call_n.tgz . && find . -type f ! -name call_n.tgz -delete  # at most 8 files come back
