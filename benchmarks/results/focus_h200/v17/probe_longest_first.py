"""Device probe (v17, written in session 20; ran in call R, session 21): the Triton kernels' query tiles in reverse
(`Tiling.longest_first`, the committed default) against launch order, top-1, one group per token.

Count first (8K tokens, K=8, H=8, D=128): the group set has 8 tiles of 128 queries per group, tile i walking 2(i + 1)
key steps of 64, so 576 steps per head and 4608 in all, over 132 SMs: about 35 steps per SM if balanced. In launch
order the last programs are the longest tiles of the last head's groups (16 steps), which can leave up to about 16
steps of tail; in reverse the tail is the short ones. Prediction: the group kernel up to 10-30% faster at 8K-16K, less
at 64K (more tiles per SM). The dq kernel has the same shape; dk/dv's first tiles are its longest already.

Each case: outputs of both orders equal bit for bit (forward), then the forward as CUDA-graph replays (cold L2, the
bench's `measure`) and forward+backward with plain launches, beside SDPA-cuDNN's. Writes OUT/longest_first.json."""
import dataclasses
import json
import os
import sys

import torch

import sieve_attn as sa
from sieve_attn.bench.common import forward_backward, make_qkv, sdpa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus import triton_prefill
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus.groups import FocusGroups

dev = torch.device("cuda")
committed = triton_prefill.tiling(dev)
rows = []
for length, num_groups in ((8192, 8), (8192, 16), (16384, 8), (65536, 8), (65536, 16)):
    q, k, v = make_qkv(8, 8, length, length, 128, dev)
    groups = FocusGroups.routed(balanced_groups(length, num_groups, 1).to(dev), num_groups)
    attn = lambda q_, k_, v_: focus_attention(q_, k_, v_, groups, window=128, backend="triton")
    dense = lambda q_, k_, v_: sdpa(q_, k_, v_, "cudnn", causal=True)
    with sa.skip_nan_checks():
        row = dict(T=length, K=num_groups,
                   cudnn_fwd_ms=measure(graphed(lambda: dense(q, k, v)), dev, reps=20, budget_s=1.0).ms,
                   cudnn_fwd_bwd_ms=measure(forward_backward(dense, q, k, v), dev, reps=10, budget_s=1.0).ms)
        outputs = {}
        for longest_first in (False, True):
            triton_prefill.tiling = lambda device, plan=dataclasses.replace(committed, longest_first=longest_first): plan
            outputs[longest_first] = attn(q, k, v)
            name = "longest_first" if longest_first else "launch_order"
            row[name + "_fwd_ms"] = measure(graphed(lambda: attn(q, k, v)), dev, reps=20, budget_s=1.0).ms
            row[name + "_fwd_bwd_ms"] = measure(forward_backward(attn, q, k, v), dev, reps=10, budget_s=1.0).ms
        row["same_output"] = torch.equal(outputs[False], outputs[True])
    for key in ("fwd", "fwd_bwd"):
        for name in ("launch_order", "longest_first"):
            row[f"{name}_{key}_x_cudnn"] = row[f"cudnn_{key}_ms"] / row[f"{name}_{key}_ms"]
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               rows=rows), open(os.path.join(sys.argv[1], "longest_first.json"), "w"), indent=1)
