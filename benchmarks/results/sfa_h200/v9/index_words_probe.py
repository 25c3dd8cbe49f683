"""Device probe (v9, session 25; not a library file; v8's keys_major_probe.py with other knobs): the SFA decode kernel
reading each key's packed indices as 4-byte words (staged by the software pipeline) instead of bytes (left in the
loop), against the package the probe is imported from (run it once from a checkout of the previous commit and once
from the new tree, in one call). 128K cached tokens,
GQA 32/8, bf16, batch 1, CUDA-graph replays with a cold L2 (sieve_attn.bench.timing), against dense SDPA decode.

Each variant is first checked the way the tests check it: its error against the float64 reference at most twice
the error of the reference run in bfloat16 (plus 1e-6); a variant that fails prints FAIL and no time.

Knobs (module globals of the decode module): _NUM_STAGES, _programs_per_sm (PROBE_STAGES, PROBE_PROGRAMS);
PROBE_NO_PDL=1: no programmatic dependent launches (SFA decode and the merge).
Usage: python index_words_probe.py OUT TAG, PROBE_DIMS=128,64 (head dims), PROBE_PLAN=plan|defaults. Writes OUT/index_words_TAG_PLAN_DIMS.json."""
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
if os.environ.get("PROBE_NO_PDL"):  # the tree's decode steps without programmatic dependent launches
    from sieve_attn.ops import split_k
    for module in (sfa_decode_module, split_k):
        module.hopper_or_newer = lambda device: False  # (named programmatic_launch when call C ran)
dev = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))  # cpu with TRITON_INTERPRET=1: a smoke test
B, HQ, HKV, T = 1, 32, 8, int(os.environ.get("PROBE_TOKENS", 131072))
rows = []
if os.environ.get("PROBE_PLAN", "plan") == "plan":  # the new kernel's plan swept (14 KB of shared memory, 155
    # registers: up to 12 programs per SM); the previous commit's package has no word reads and runs its defaults
    SFA_KNOBS = {"_NUM_STAGES": tuple(int(x) for x in os.environ.get("PROBE_STAGES", "3,4").split(",")),
                 "_programs_per_sm": tuple((lambda *args, p=int(p): p)
                                           for p in os.environ.get("PROBE_PROGRAMS", "8,10,12,16").split(","))}
else:  # "defaults": each package as it is
    SFA_KNOBS = {}
FOCUS_KNOBS = {} if os.environ.get("PROBE_FOCUS") else None  # PROBE_FOCUS=1: Focus decode too, at its defaults


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

    for name, top_k in (("top1", 1), ("top2", 2)) if FOCUS_KNOBS is not None else ():
        ids = balanced_groups(T, 8, top_k).to(dev)
        bits = group_bits(ids)
        kw = dict(window=128, causal=True, scale=scale)
        exact = focus_attention_reference(q.double(), k.double(), v.double(), ids, **kw)[0]
        low = focus_attention_reference(q, k, v, ids, **kw)[0]
        sweep(focus_decode_module, FOCUS_KNOBS,
              lambda: focus_decode_module.focus_decode(q, k, v, bits, window=128, scale=scale)[0], exact,
              err(low, exact), dict(kernel="focus", pattern=name, tag=tag, D=head_dim, dense_ms=dense_ms))

compiled = []
for kernel_fn in (sfa_decode_module._sfa_decode_chunk, focus_decode_module._focus_decode_chunk) if dev.type == "cuda" else ():
    for cache in kernel_fn.device_caches.values():
        for kernel in cache[0].values():
            compiled.append(dict(name=str(kernel.metadata.name), n_regs=kernel.n_regs, n_spills=kernel.n_spills,
                                 shared=kernel.metadata.shared))
json.dump(dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__, tag=tag,
               rows=rows, compiled=compiled),
          open(os.path.join(out_dir, f"index_words_{tag}_{os.environ.get('PROBE_PLAN', 'plan')}_D{os.environ.get('PROBE_DIMS', '128,64').replace(',', '-')}.json"), "w"), indent=1)
