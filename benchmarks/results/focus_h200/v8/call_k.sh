#!/bin/bash
# Session 12, call K (nvidia-h200-x2; call L reuses /tmp): GGUF half 1 etc. to /tmp. GPU 0: CUDA tests of the window-first
# sdpa forward and the merge kernel, then top-2 triton bench and the v8 profile again. GPU 1: the top-1 bench 16K-1M.
cp scratch/gguf.part00 /tmp/part00; cp scratch/windows1024.pt /tmp/windows1024.pt
python3 -m pip install -q --no-index --no-deps --target /tmp/site scratch/whl/*.whl
mkdir -p /tmp/r; R=/tmp/r; rm -rf /tmp/r/*
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
git log --oneline -1 > $R/commit.txt; git status --short >> $R/commit.txt
CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -m sieve_attn.cli bench focus --backend triton --backends sdpa \
    --lengths 16K,64K,256K,1M --groups 8,16 --top-k 1 --backward --max-backward-length 256K --decode-lengths '' \
    --baselines cudnn,prototype --reps 5 --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $R/bench_top1 \
    > $R/bench_top1.txt 2>&1 &
CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8 timeout 230 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/ops/test_merge.py \
    tests/ops/test_gather.py tests/ops/test_focus_sdpa.py tests/ops/test_focus_triton.py tests/ops/test_focus_groups.py \
    > $R/pytest_cuda.txt 2>&1
grep -E "passed|failed|FAILED|Error" $R/pytest_cuda.txt | tail -20
CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m sieve_attn.cli bench focus --backend triton --lengths 64K,256K \
    --groups 8 --top-k 2 --backward --max-backward-length 64K --decode-lengths '' --baselines cudnn --reps 5 \
    --budget 0.5 --max-call-seconds 6 --skip-nan-checks --out $R/bench_top2 > $R/bench_top2.txt 2>&1
tail -8 $R/bench_top2.txt
CUDA_VISIBLE_DEVICES=0 OUT=$R timeout 100 python3 scratch/profile_v8.py > $R/profile_v8.txt 2>&1
wait
tail -25 $R/bench_top1.txt
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
