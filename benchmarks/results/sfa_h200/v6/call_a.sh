# Device call A (session 13): CUDA tests of the SFA cache/decode, the decode probe, ncu of both kernels.
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.  # scratch/old/decode_v4.py: git show 79cc8b2:sieve_attn/ops/sfa/decode.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
python3 -m pytest -q tests/ops/test_sfa_cache.py 2>&1 | tee $OUT/pytest_sfa_cache_stdout.txt | tail -4
python3 benchmarks/results/sfa_h200/v6/decode_probe.py $OUT 128 2>&1 | tee $OUT/decode_probe_stdout.txt
for kern in v6 v4; do
  timeout 240 ncu --clock-control none --kernel-name regex:_sfa_decode_chunk --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    python3 benchmarks/results/sfa_h200/v6/ncu_one.py $kern > $OUT/ncu_$kern.txt 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|Issue Slots Busy|Issued Ipc|No Eligible|Achieved Occupancy|Registers Per|Shared Memory Config|Block Limit|Warp Cycles Per Issued|Stall|Executed Ipc" $OUT/ncu_$kern.txt | head -40
done
