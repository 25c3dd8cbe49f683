"""Device probe (v8, session 24; not a library file): both decode kernels with keys-major tiles (scores [keys, rows],
P @ V issued as V^T @ P^T so the few query rows are the MMA's N), against the package the probe is imported from
(run it once from a checkout of the previous commit and once from the new tree, in one call). 128K cached tokens,
GQA 32/8, bf16, batch 1, CUDA-graph replays with a cold L2 (sieve_attn.bench.timing), against dense SDPA decode.

Each variant is first checked the way the tests check it: its error against the float64 reference at most twice
the error of the reference run in bfloat16 (plus 1e-6); a variant that fails prints FAIL and no time.

Variants (module globals of the decode modules, where the tree has them): _SPLIT_P (P in two 16-bit halves or
one), _V_TMA (SFA: the V tile through a TMA tensor descriptor), _PROGRAMS_PER_SM, _NUM_STAGES (SFA).
Usage: python keys_major_probe.py OUT TAG, PROBE_DIMS=128,64 (head dims), PROBE_PLAN=variants|plan. Writes OUT/keys_major_TAG_DIMS.json."""
import itertools
import json
import os
import sys

import torch
import triton

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import first_working_sdpa, sdpa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops.focus import decode as focus_decode_module
from sieve_attn.ops.focus.reference import focus_attention_reference, group_bits
from sieve_attn.ops.sfa import decode as sfa_decode_module
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.reference import sfa_attention_reference

out_dir, tag = sys.argv[1], sys.argv[2]
dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))  # cpu with TRITON_INTERPRET=1: a smoke test
B, HQ, HKV, T = 1, 32, 8, int(os.environ.get("PROBE_TOKENS", 131072))
rows = []
if os.environ.get("PROBE_PLAN", "variants") == "variants":  # call A: the variants
    SFA_KNOBS = dict(_SPLIT_P=(True, False), _V_TMA=(False, True), _PROGRAMS_PER_SM=(8, 12, 16))
    FOCUS_KNOBS = dict(_SPLIT_P=(True, False), _PROGRAMS_PER_SM=(6, 8, 12))
else:  # call B: the plan of the chosen variant (the tree's defaults), re-swept
    SFA_KNOBS = {"_NUM_STAGES": (2, 3), "_PROGRAMS_PER_SM": (8, 10, 12), "_BLOCK_N,_NUM_WARPS": ((32, 1), (64, 2))}
    FOCUS_KNOBS = {"_num_stages": tuple((lambda d, i, s=s: s) for s in (2, 3)), "_PROGRAMS_PER_SM": (6, 8, 10)}


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def timed(fn):
    return measure(graphed(fn) if dev.type == "cuda" else fn, dev, warmup=3, reps=50, budget_s=1.0).ms


def sweep(module, knobs, run, exact, low_err, base):
    """Runs each combination of knobs (name -> values; "a,b" -> tuples set together; names the module lacks are
    skipped), gated, timed."""
    names = [n for n in knobs if all(hasattr(module, part) for part in n.split(","))]
    saved = {part: getattr(module, part) for n in names for part in n.split(",")}
    for values in itertools.product(*(knobs[n] for n in names)):
        settings = {}
        for n, value in zip(names, values):
            settings.update(zip(n.split(","), value) if "," in n else [(n, value)])
        for part, value in settings.items():
            setattr(module, part, value)
        row = dict(base, **{part: value if not callable(value) else value(128, 2) for part, value in settings.items()})
        try:
            out = run()
            e = err(out, exact)
            row.update(err=e, err_ratio=e / low_err, ok=e <= 2 * low_err + 1e-6)
            if row["ok"]:
                row["ms"] = timed(run)
                row["x_dense"] = row["dense_ms"] / row["ms"]
        except Exception as error:  # a plan Triton cannot build
            row["error"] = repr(error)[:300]
        rows.append(row)
        print(("" if row.get("ok") else "FAIL ") + json.dumps(row), flush=True)
    for n, value in saved.items():
        setattr(module, n, value)


torch.manual_seed(0)
for head_dim in (int(d) for d in os.environ.get("PROBE_DIMS", "128,64").split(",")):
    q = torch.randn(B, HQ, 1, head_dim, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, T, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
    backend = first_working_sdpa(q, k, v, causal=False)
    dense_ms = timed(lambda: sdpa(q, k, v, backend, causal=False))
    print(f"D={head_dim} dense sdpa decode ({backend}) {dense_ms:.4f} ms", flush=True)
    rows.append(dict(kernel="dense", D=head_dim, ms=dense_ms, backend=backend))
    scale = head_dim ** -0.5

    for topk in (8, 16):
        cache = SFAKeyCache(B, HKV, head_dim, topk=topk, dtype=torch.bfloat16, device=dev, capacity=T)
        cache.append(k, v)
        exact = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True, scale=scale)[0]
        low = sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)[0]
        with skip_nan_checks():
            sweep(sfa_decode_module, SFA_KNOBS,
                  lambda: sfa_decode_module.sfa_decode_triton(q, cache, scale=scale)[0], exact, err(low, exact),
                  dict(kernel="sfa", tag=tag, D=head_dim, topk=topk, dense_ms=dense_ms))
        del cache

    for name, top_k in (("top1", 1), ("top2", 2)):
        ids = balanced_groups(T, 8, top_k).to(dev)
        bits = group_bits(ids)
        kw = dict(window=128, causal=True, scale=scale)
        exact = focus_attention_reference(q.double(), k.double(), v.double(), ids, **kw)[0]
        low = focus_attention_reference(q, k, v, ids, **kw)[0]
        sweep(focus_decode_module, FOCUS_KNOBS,
              lambda: focus_decode_module.focus_decode(q, k, v, bits, window=128, scale=scale)[0], exact,
              err(low, exact), dict(kernel="focus", pattern=name, tag=tag, D=head_dim, dense_ms=dense_ms))

compiled = []
for kernel_fn in (sfa_decode_module._sfa_decode_chunk, focus_decode_module._focus_decode_chunk):
    for cache in kernel_fn.device_caches.values():
        for kernel in cache[0].values():
            compiled.append(dict(name=str(kernel.metadata.name), n_regs=kernel.n_regs, n_spills=kernel.n_spills,
                                 shared=kernel.metadata.shared))
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, tag=tag,
               rows=rows, compiled=compiled),
          open(os.path.join(out_dir, f"keys_major_{tag}_{os.environ.get('PROBE_PLAN', 'variants')}_{os.environ.get('PROBE_DIMS', '128,64')}.json"), "w"), indent=1)
