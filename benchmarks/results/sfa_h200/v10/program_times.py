"""Device probe (v10, session 26; not a library file): when each program of the SFA decode kernel starts, gets past
its wait for the query table, and ends, and on which SM (PTX %globaltimer, %smid), to see how much of the kernel's
time is ramp-up, imbalance between SMs, and tail. The tree's decode.py with three timer reads patched in (text
patch, written beside it as a module). One step at 128K, k=16, GQA 32/8, D=128, bf16, replayed as a CUDA graph after
20 warm replays and an L2 flush. Usage: [PROBE_PLAN=POOLED:UNIT:STAGES:PER_SM] python program_times.py OUT. Writes OUT/program_times.json."""
import importlib
import json
import os
import statistics
import sys

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.timing import graphed
from sieve_attn.ops.sfa import decode as head
from sieve_attn.ops.sfa.cache import SFAKeyCache

CLOCK = 'tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)'
PATCHES = [
    ("V, V_DESC, O, LSE,\n", "V, V_DESC, O, LSE, TIMES,\n"),
    ("    wait_for_prior_kernel()  # the query table (a programmatic dependent launch where the GPU can)\n",
     f"    t_start = {CLOCK}\n    wait_for_prior_kernel()\n    t_wait = {CLOCK}\n"),
    ("    store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM)\n",
     "    store_rows(O, LSE, out, lse, r, row_ok, d, group, q_len, num_chunks, HEAD_DIM)\n"
     f"    t_end = {CLOCK}\n"
     "    sm = tl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [], dtype=tl.int32, is_pure=False, pack=1)\n"
     "    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)\n"
     "    tl.store(TIMES + pid * 4, t_start)\n    tl.store(TIMES + pid * 4 + 1, t_wait)\n"
     "    tl.store(TIMES + pid * 4 + 2, t_end)\n    tl.store(TIMES + pid * 4 + 3, sm.to(tl.int64))\n"),
    ("v, v_tiles, part_out, part_lse,\n", "v, v_tiles, part_out, part_lse, TIMES,\n"),
]

source = open(head.__file__).read()
for old, new in PATCHES:
    assert source.count(old) == 1, old
    source = source.replace(old, new)
open(os.path.join(os.path.dirname(head.__file__), "_probe_times.py"), "w").write(source)
module = importlib.import_module("sieve_attn.ops.sfa._probe_times")
if os.environ.get("PROBE_PLAN"):  # POOLED:UNIT:STAGES:PROGRAMS_PER_SM (the pool's knobs, where the tree has them)
    pooled, unit, stages, per_sm = os.environ["PROBE_PLAN"].split(":")
    module._POOLED, module._UNIT_TILES, module._NUM_STAGES = float(pooled), int(unit), int(stages)
    module._programs_per_sm = lambda head_dim, p=int(per_sm): p
dev = torch.device("cuda")
module.TIMES = torch.zeros(4096 * 4, dtype=torch.int64, device=dev)
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, 128
q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
cache = SFAKeyCache(1, HKV, D, topk=16, dtype=torch.bfloat16, device=dev, capacity=T)
cache.append(k, v)
flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
with skip_nan_checks():
    replay = graphed(lambda: module.sfa_decode_triton(q, cache, scale=D ** -0.5))
result = []
for rep in range(5):
    for _ in range(20):
        replay()
    flush.zero_()
    module.TIMES.zero_()
    replay()
    torch.cuda.synchronize()
    t = module.TIMES.view(-1, 4)
    t = t[t[:, 2] > 0].cpu()
    t0 = t[:, 0].min().item()
    start, waited, end, sm = ((t[:, i] - (t0 if i < 3 else 0)).tolist() for i in range(4))
    per_sm = {}
    for s_, e_ in zip(sm, end):
        per_sm.setdefault(s_, []).append(e_)
    counts = [len(x) for x in per_sm.values()]
    row = dict(programs=len(end), sms=len(per_sm), programs_per_sm=dict((c, counts.count(c)) for c in set(counts)),
               start_us=[x / 1000 for x in (min(start), statistics.median(start), max(start))],
               waited_us=[x / 1000 for x in (min(waited), statistics.median(waited), max(waited))],
               end_us=[x / 1000 for x in (min(end), statistics.quantiles(end, n=10)[0], statistics.median(end),
                                           statistics.quantiles(end, n=10)[-1], max(end))],
               run_us_median=statistics.median(e - w for e, w in zip(end, waited)) / 1000,
               last_end_by_count={c: max(max(x) for x in per_sm.values() if len(x) == c) / 1000 for c in set(counts)})
    result.append(row)
    print(json.dumps(row), flush=True)
json.dump(result, open(os.path.join(sys.argv[1], f"program_times{os.environ.get('PROBE_TAG', '')}.json"), "w"), indent=1)
