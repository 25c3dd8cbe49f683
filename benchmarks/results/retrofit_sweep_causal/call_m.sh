#!/bin/bash
# Call M (nvidia-h200-x2; call N reuses /tmp): GGUF half 1, windows, wheel to /tmp.
cp scratch/gguf.part00 /tmp/part00; cp scratch/windows1024.pt /tmp/windows1024.pt
python3 -m pip install -q --no-index --no-deps --target /tmp/site scratch/whl/*.whl
mkdir -p /tmp/r; rm -rf /tmp/r/*; ls -l /tmp/part00
