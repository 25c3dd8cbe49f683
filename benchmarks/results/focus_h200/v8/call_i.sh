#!/bin/bash
# Call I (nvidia-h200-x2; call J reuses /tmp): GGUF half 1, windows, wheel to /tmp; host time per stage of a forward.
cp scratch/gguf.part00 /tmp/part00; cp scratch/windows1024.pt /tmp/windows1024.pt
python3 -m pip install -q --no-index --no-deps --target /tmp/site scratch/whl/*.whl
mkdir -p /tmp/r; R=/tmp/r
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=0 OUT=$R timeout 200 python3 scratch/host_v8.py > $R/host_v8.txt 2>&1
cat $R/host_v8.txt | tail -n 60
tar czf $OUT/results.tgz -C $R .; ls -l $OUT
