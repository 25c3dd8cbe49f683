"""Device probe (v16): where the host time of a plain-launch 8K top-1 Triton forward goes. v14's profile: the
call's kernels take 0.23 ms of its 0.60 ms, so the host issues it more slowly than the GPU runs it.

Times N calls queued back to back (one synchronisation at the end: the host's issue rate) two ways: as a user calls
it, with raw ids (validated, two host reads) and the NaN checks (one more), and as a composed model does, with
FocusGroups.routed inside skip_nan_checks (no host read; the bench's rows). Then profiles N calls of the second with
cProfile, by own and by cumulative time, and the CUDA kernels of one call (torch.profiler). Call M ran only the
first way (before the second was added). 8K tokens, 8 heads, D=128, bf16, K=8, one group per token, window 128, no gradients.
Writes OUT/host_profile.txt (OUT: the first argument)."""
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

import torch

from sieve_attn.bench.focus import balanced_groups
from sieve_attn import skip_nan_checks
from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.focus.groups import FocusGroups

dev = torch.device("cuda")
torch.manual_seed(0)
T, H, D, K, N = 8192, 8, 128, 8, 200
q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
ids = balanced_groups(T, K, 1).to(dev)[..., 0]


def _queued(label, call):
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(N):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (f"{label}: host issue {1e3 * (issued - start) / N:.4f} ms per call, "
            f"all done {1e3 * (done - start) / N:.4f} ms per call")


checked = lambda: focus_attention(q, k, v, ids, window=128, backend="triton")
routed = lambda: focus_attention(q, k, v, FocusGroups.routed(ids[..., None], K), window=128, backend="triton")
lines = []
for label, call in (("raw ids, checks", checked), ("routed, no checks", routed)) * 2:
    with skip_nan_checks() if call is routed else contextlib.nullcontext():
        lines.append(_queued(label, call))
call = routed
profile = cProfile.Profile()
with skip_nan_checks():
    profile.enable()
    for _ in range(N):
        call()
    profile.disable()
    torch.cuda.synchronize()
for key in ("tottime", "cumulative"):
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(key).print_stats(45)
    lines.append(f"--- by {key}, {N} calls ---\n" + text.getvalue())
activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with skip_nan_checks(), torch.profiler.profile(activities=activities) as prof:
    call()
    torch.cuda.synchronize()
lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=60))
text = "\n".join(lines)
print(text[:6000])
open(os.path.join(sys.argv[1], "host_profile.txt"), "w").write(text)
