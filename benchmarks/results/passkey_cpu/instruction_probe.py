"""Why Focus misses a key that sits inside its window (session 46): dense SmolLM2 scored by `sieve eval passkey`'s
own scoring on the whole prompt, on only what a 256-token window holds (filler, needle and question, no intro), and
on that with the intro put back before it. Writes instruction_probe.json beside this file.

    .venv/bin/python benchmarks/results/passkey_cpu/instruction_probe.py
"""
import dataclasses
import json
import pathlib

import torch

from sieve_attn.eval.passkey import INTRO, passkey_prompts, passkey_retrieval
from sieve_attn.models import load_model

torch.set_num_threads(2)
model, tokenizer = load_model()
intro = tuple(tokenizer(INTRO, add_special_tokens=False).input_ids)
rows = []
for prompt in passkey_prompts(tokenizer, [512, 1024], [1.0], 4, seed=0):
    tail = prompt.ids[-256:]
    for context, ids in (("whole prompt", prompt.ids), ("last 256 tokens", tail), ("intro + last 256 tokens",
                                                                                    intro + tail)):
        row, = passkey_retrieval(model, tokenizer, [dataclasses.replace(prompt, ids=ids)], progress=False)
        rows.append({"context": context, "tokens": len(ids), **row})
        print(rows[-1], flush=True)
path = pathlib.Path(__file__).with_name("instruction_probe.json")
path.write_text(json.dumps({"model": "SmolLM2-135M, dense, float32, CPU", "rows": rows}, indent=1) + "\n")
