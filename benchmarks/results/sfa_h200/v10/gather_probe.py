"""Device probe (v10, session 26; not a library file): the SFA decode kernel with its query-table gathers as one
L1 load each that the software pipeliner cannot stage ("tree": inline PTX ld.global.nc, `_table_entries`),
against the same kernel with the gathers as tl.load ("staged": Triton stages each through shared memory, 8 KB per
program at 5 stages, which caps residency at 8 programs per SM; the code before this session). Offline (triton 3.6, sm_90): l1 at 3 stages 19.7 KB of shared
memory (2 V buffers, 617 loop instructions), 4 stages 29.5 KB (3 buffers); head 27.9 KB at 5 stages (2 buffers, 633).

The staged variant is the tree's decode.py with the PTX branch of _table_entries switched off (patched text,
written beside it as a module and imported). (Call B ran this probe's first version: a patched l1 gather against
the tree of f9a3da8, timed one plan after another.)
Each plan (variant:stages:programs per SM) is gated like the tests (error against float64 at most twice the error
of the reference run in bfloat16, plus 1e-6; FAIL prints no time), then timed as CUDA-graph replays with a cold
L2 (sieve_attn.bench.timing, 50 reps), hot: all plans first built and gated, then timed once each per round in
PROBE_ROUNDS (5) interleaved rounds beside dense SDPA-cuDNN decode; the median of the rounds is reported. 128K cached tokens, GQA 32/8, D=128, bf16, batch 1.
Usage: PROBE_DIM=128 python gather_probe.py OUT [plans]. Writes OUT/gather_probe_D{D}.json."""
import importlib
import json
import os
import statistics
import sys

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.sfa import decode as head
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.reference import sfa_attention_reference

L1_GATHER = "    if _PTX and (WORDS == 1 or WORDS == 2 or WORDS == 4):\n"


def variant(name):
    """"tree": the decode module as it is (l1 gathers); "staged": the same with _table_entries' tl.load path
    everywhere (the gathers staged through shared memory, as before)."""
    if name == "tree":
        return head
    source = open(head.__file__).read()
    assert L1_GATHER in source
    path = os.path.join(os.path.dirname(head.__file__), "_probe_staged.py")
    open(path, "w").write(source.replace(L1_GATHER, "    if False:\n"))
    return importlib.import_module("sieve_attn.ops.sfa._probe_staged")


out_dir = sys.argv[1]
plans = (sys.argv[2] if len(sys.argv) > 2 else
         "staged:5:8,tree:3:8,tree:3:10,tree:3:11,tree:4:6,tree:4:7,tree:5:5").split(",")
dev = torch.device("cuda")
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, int(os.environ.get("PROBE_DIM", 128))
q = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
scale = D ** -0.5


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


rows = []
dense = graphed(lambda: sdpa(q, k, v, "cudnn", causal=False))
ROUNDS = int(os.environ.get("PROBE_ROUNDS", 5))
for topk in (16, 8):
    cache = SFAKeyCache(1, HKV, D, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
    cache.append(k, v)
    exact = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True, scale=scale)[0]
    low_err = err(sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)[0], exact)
    timers = {"dense": dense}
    for plan in dict.fromkeys(plans):
        name, stages, per_sm = plan.split(":")
        module = variant(name)
        module._NUM_STAGES = int(stages)
        module._programs_per_sm = lambda head_dim, p=int(per_sm): p
        row = dict(plan=plan, topk=topk)
        try:
            with skip_nan_checks():
                run = lambda m=module: m.sfa_decode_triton(q, cache, scale=scale)[0]
                e = err(run(), exact)
                row.update(err_ratio=e / low_err, ok=e <= 2 * low_err + 1e-6)
                if row["ok"]:
                    timers[plan] = graphed(run)  # captured with this plan's knobs
        except Exception as error:
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(("" if row.get("ok") else "FAIL ") + json.dumps(row), flush=True)
    # Every plan timed once per round, hot (no compile between), rounds interleaved: drift hits all alike.
    times = {name: [] for name in timers}
    for _ in range(ROUNDS):
        for name, replay in timers.items():
            times[name].append(measure(replay, dev, warmup=20, reps=50, budget_s=1.0).ms)
    for name, samples in times.items():
        row = dict(plan=name, topk=topk, rounds=samples, ms=statistics.median(samples),
                   x_dense=statistics.median(times["dense"]) / statistics.median(samples))
        rows.append(row)
        print(json.dumps(row), flush=True)
    del cache, timers
compiled = []
for module in {variant(n) for n in ("tree", "staged")}:
    for cache in module._sfa_decode_chunk.device_caches.values():
        for kernel in cache[0].values():
            compiled.append(dict(module=module.__name__, n_regs=kernel.n_regs, n_spills=kernel.n_spills,
                                 shared=kernel.metadata.shared))
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, compiled=compiled),
          open(os.path.join(out_dir, f"gather_probe_D{D}.json"), "w"), indent=1)
