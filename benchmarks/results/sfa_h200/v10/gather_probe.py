"""Device probe (v10, session 26; not a library file): the SFA decode kernel with its query-table gathers as one
8-byte L1 load each that the software pipeliner cannot stage ("l1": inline PTX ld.global.nc.v2.b32, 4 bfloat16
rows), against the tree as it is ("head": Triton stages each gather through shared memory, 8 KB per program at 5
stages, which caps residency at 8 programs per SM). Offline (triton 3.6, sm_90): l1 at 3 stages 19.7 KB of shared
memory (2 V buffers, 617 loop instructions), 4 stages 29.5 KB (3 buffers); head 27.9 KB at 5 stages (2 buffers, 633).

The l1 variant is the tree's decode.py with _code_scores' gather replaced (patched text, written beside it as a
module and imported); only valid where BLOCK_M = 4 and the table is 16-bit (GQA 32/8, one query token: this probe).
Each plan (variant:stages:programs per SM) is gated like the tests (error against float64 at most twice the error
of the reference run in bfloat16, plus 1e-6; FAIL prints no time), then timed as CUDA-graph replays with a cold
L2 (sieve_attn.bench.timing, 50 reps), hot: all plans first built and gated, then timed once each per round in
PROBE_ROUNDS (5) interleaved rounds beside dense SDPA-cuDNN decode; the median of the rounds is reported. 128K cached tokens, GQA 32/8, D=128, bf16, batch 1.
Usage: python gather_probe.py OUT [plans]. Writes OUT/gather_probe.json."""
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

GATHER = """        q_at = tl.load(table + coord[:, None] * BLOCK_M + m[None, :])
        # Products of 16-bit values are exact in float32, as in a tensor-core dot.
        s += q_at.to(tl.float32) * value[:, None]"""
L1_GATHER = """        addr = (table + coord * BLOCK_M).to(tl.int64, bitcast=True)
        lo, hi = tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [addr],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        q_at = tl.join(tl.join((lo << 16).to(tl.float32, bitcast=True), (hi << 16).to(tl.float32, bitcast=True)),
                       tl.join((lo & -65536).to(tl.float32, bitcast=True),
                               (hi & -65536).to(tl.float32, bitcast=True))).reshape(BLOCK_N, BLOCK_M)
        s += q_at * value[:, None]"""


def variant(name):
    if name == "head":
        return head
    source = open(head.__file__).read()
    assert GATHER in source
    path = os.path.join(os.path.dirname(head.__file__), "_probe_l1.py")
    open(path, "w").write(source.replace(GATHER, L1_GATHER))
    return importlib.import_module("sieve_attn.ops.sfa._probe_l1")


out_dir = sys.argv[1]
plans = (sys.argv[2] if len(sys.argv) > 2 else
         "head:5:8,l1:3:8,l1:3:11,l1:4:6,l1:4:7,l1:5:5").split(",")
dev = torch.device("cuda")
torch.manual_seed(0)
T, HQ, HKV, D = 131072, 32, 8, 128
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
for module in {variant(n) for n in ("head", "l1")}:
    for cache in module._sfa_decode_chunk.device_caches.values():
        for kernel in cache[0].values():
            compiled.append(dict(module=module.__name__, n_regs=kernel.n_regs, n_spills=kernel.n_spills,
                                 shared=kernel.metadata.shared))
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, compiled=compiled),
          open(os.path.join(out_dir, "gather_probe.json"), "w"), indent=1)
