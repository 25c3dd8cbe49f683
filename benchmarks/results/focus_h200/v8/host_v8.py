"""Host time of each stage of a Focus forward (sdpa at 64K top-1, triton at 8K top-1), GPU idle between calls:
wrappers time each stage's Python and launches (perf_counter, no synchronisation inside)."""
import json, os, time, torch
from collections import defaultdict
import sieve_attn as sa
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.ops.focus.groups import FocusGroups
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus import decomposed, triton_prefill, layout, attention
from sieve_attn.ops import gather

stages = defaultdict(float)


def wrap(owner, name, label=None, static=False, cls=False):
    f = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"
    def g(*a, **kw):
        t0 = time.perf_counter()
        r = f(*a, **kw)
        stages[label] += time.perf_counter() - t0
        return r
    setattr(owner, name, classmethod(lambda c, *a, **kw: g(*a, **kw)) if cls else (staticmethod(g) if static else g))


of = decomposed.SortedGroups.of.__func__
def sorted_of(cls, *a):
    t0 = time.perf_counter(); r = of(cls, *a); stages["SortedGroups.of"] += time.perf_counter() - t0; return r
decomposed.SortedGroups.of = classmethod(sorted_of)
for owner, name in ((decomposed._TokenSets, "__init__"), (triton_prefill.WindowSet, "__init__"),
                    (decomposed.SortedGroups, "pack"), (decomposed.SortedGroups, "to_tokens"),
                    (decomposed, "causal_call"), (triton_prefill.WindowSet, "forward"), (decomposed._Plan, "__init__"),
                    (decomposed.PlanAttention, "apply"), (triton_prefill, "group_layout"),
                    (triton_prefill._Kernels, "__init__"), (triton_prefill._Kernels, "_launch_forward"),
                    (triton_prefill._Pattern, "forward"), (triton_prefill._Pattern, "__init__"),
                    (attention, "_resolve")):
    wrap(owner, name)
dev = torch.device("cuda")
res = {}
for T, backend in ((65536, "sdpa"), (8192, "triton"), (8192, "sdpa")):
    q, k, v = (torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    pre = FocusGroups.of(balanced_groups(T, 8, 1).to(dev), 1, T, dev)
    with sa.skip_nan_checks():
        for _ in range(3):
            focus_attention(q, k, v, pre, window=128, backend=backend)
        torch.cuda.synchronize()
        stages.clear()
        n, total = 20, 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            focus_attention(q, k, v, pre, window=128, backend=backend)
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
    r = {"call_host_ms": round(total / n * 1000, 4)}
    r.update({a: round(b / n * 1000, 4) for a, b in sorted(stages.items(), key=lambda x: -x[1])})
    res[f"T{T}_{backend}"] = r
    print(T, backend, json.dumps(r, indent=1), flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/host_v8.json", "w"), indent=1)
