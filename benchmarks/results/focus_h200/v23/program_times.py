"""Device probe (Focus v23, session 30; not a library file): when each program of the Focus decode kernel starts,
ends its scan (pass 1, at the barrier) and ends, and on which SM (PTX %globaltimer, %smid), to split the kernel's
fixed ~15 us into ramp, scan, waves and tail. The tree's decode.py with timer reads patched in (a text patch,
written beside it as a module; SFA's v10 probe did the same for its kernel). One step at 128K, K=8 (top-1 and
top-2), GQA 32/8, D=128, bf16, replayed as a CUDA graph after 20 warm replays and an L2 flush, 5 times.
Usage: python program_times.py OUT. Writes OUT/program_times.json."""
import importlib
import json
import os
import statistics
import sys

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed
from sieve_attn.ops.focus import decode as library
from sieve_attn.ops.focus.reference import group_bits

CLOCK = 'tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'
SLOT = "(tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)"
PATCHES = [
    ("    Q, K, V, BITS, KEYS, O, LSE,\n", "    Q, K, V, BITS, KEYS, O, LSE, TIMES,\n"),
    ("    b, kv_head, r, row_ok, q_pos, d, q, _, start, stop = program_rows(\n",
     f"    t_start = {CLOCK}\n    b, kv_head, r, row_ok, q_pos, d, q, _, start, stop = program_rows(\n"),
    ("    tl.debug_barrier()\n", f"    tl.debug_barrier()\n    t_scan = {CLOCK}\n"),
    ("    store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM)\n",
     "    store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM)\n"
     f"    t_end = {CLOCK}\n"
     "    sm = tl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [], dtype=tl.int32, is_pure=False, pack=1)\n"
     f"    slot = {SLOT}\n"
     "    tl.store(TIMES + slot * 4, t_start)\n    tl.store(TIMES + slot * 4 + 1, t_scan)\n"
     "    tl.store(TIMES + slot * 4 + 2, t_end)\n    tl.store(TIMES + slot * 4 + 3, sm.to(tl.int64))\n"),
    ("            q, k, v, bits, keys, part_out, part_lse,\n", "            q, k, v, bits, keys, part_out, part_lse, TIMES,\n"),
]

source = open(library.__file__).read()
for old, new in PATCHES:
    assert source.count(old) == 1, old
    source = source.replace(old, new)
open(os.path.join(os.path.dirname(library.__file__), "_probe_times.py"), "w").write(source)
module = importlib.import_module("sieve_attn.ops.focus._probe_times")
dev = torch.device("cuda")
module.TIMES = torch.zeros(8192 * 4, dtype=torch.int64, device=dev)
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, 128
q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)


def spread(values):
    """min, 10%, median, 90%, max, in us."""
    deciles = statistics.quantiles(values, n=10)
    return [round(x / 1000, 2) for x in (min(values), deciles[0], statistics.median(values), deciles[-1], max(values))]


result = {}
for top_k in (1, 2):
    bits = group_bits(balanced_groups(T, 8, top_k).to(dev))
    with skip_nan_checks():
        replay = graphed(lambda: module.focus_decode(q, k, v, bits, window=128, scale=D ** -0.5))
    rows = []
    for _ in range(5):
        for _ in range(20):
            replay()
        flush.zero_()
        module.TIMES.zero_()
        replay()
        torch.cuda.synchronize()
        t = module.TIMES.view(-1, 4)
        t = t[t[:, 2] > 0].cpu()
        t0 = t[:, 0].min().item()
        start, scanned, end = ((t[:, i] - t0).tolist() for i in range(3))
        order = sorted(range(len(start)), key=lambda i: start[i])
        half = len(order) // 2  # programs by start time: the first half is (about) the first wave
        first, second = order[:half], order[half:]
        rows.append(dict(
            programs=len(start), sms=len(set(t[:, 3].tolist())),
            start_us=spread(start), scan_us=spread([s - a for s, a in zip(scanned, start)]),
            run_us=spread([e - a for e, a in zip(end, start)]), end_us=spread(end),
            first_half_start_us=spread([start[i] for i in first]), second_half_start_us=spread([start[i] for i in second]),
            second_half_end_us=spread([end[i] for i in second])))
        print(top_k, json.dumps(rows[-1]), flush=True)
    result[f"top{top_k}"] = rows
json.dump(result, open(os.path.join(sys.argv[1], "program_times.json"), "w"), indent=1)
