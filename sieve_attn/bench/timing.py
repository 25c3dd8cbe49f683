"""Wall time and peak memory of one call, the way the benchmarks report them.

On CUDA every repetition is bracketed by CUDA events and starts with a cold L2 cache (a 256 MiB buffer is written
between repetitions; the H200's L2 holds 60 MB), so a kernel is never credited with inputs left in cache by its own
previous run. On the CPU ``time.perf_counter`` brackets each call and no memory is reported.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

L2_FLUSH_BYTES = 256 * 2 ** 20
# The shortest warm-up, in seconds, of a call that is warmed up at all (triton.testing.do_bench warms up 25 ms too).
# A few calls were not enough for a decode step replayed as a CUDA graph: SFA's pooled step at 128K (GQA 32/8, D =
# 128, k = 16, H100) ran its first 10-20 replays after capture about 14% slower than every later one, so 3 warm-up
# calls and 10 timed read 0.143 ms where 20 and 10, or 3 and 50, read 0.125-0.126, and so did the probe
# (benchmarks/results/session34, calls G-I: dense, Focus and SFA's unpooled 32K step did not move; why the
# pooled step starts slow is not known).
WARMUP_S = 0.025


@dataclass(frozen=True)
class Timing:
    """Median milliseconds over ``reps`` timed calls, and the peak GPU memory (GB, 1e9 bytes) while they ran, inputs
    included, the L2 flush buffer excluded (None on the CPU)."""
    ms: float
    reps: int
    peak_gb: Optional[float]


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10,
            budget_s: float = 2.0) -> Timing:
    """Times ``fn()``: ``warmup`` untimed calls, and more while they have taken less than :data:`WARMUP_S` (none
    at ``warmup`` 0), then up to ``reps`` timed ones.

    The first timed call sets how many follow: as many as fit in ``budget_s`` (at least that one), so a call of
    several seconds is timed once. Its return value is dropped at once, so outputs do not pile up in the peak.
    """
    _warm_up(fn, device, warmup)
    if device.type == "cuda":
        return _measure_cuda(fn, device, reps, budget_s)
    return _measure_cpu(fn, reps, budget_s)


def _warm_up(fn: Callable[[], object], device: torch.device, calls: int) -> None:
    """``calls`` calls of ``fn``, then, while they have all taken less than :data:`WARMUP_S`, as many more as their
    pace says fill it, queued and waited for a batch at a time."""
    started, done, batch = time.perf_counter(), 0, calls
    while batch:
        for _ in range(batch):
            fn()
        done += batch
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        batch = 0 if elapsed >= WARMUP_S else min(10_000, int((WARMUP_S - elapsed) / (elapsed / done)) + 1)


def _reps_within(first_ms: float, reps: int, budget_s: float) -> int:
    return max(1, min(reps, int(budget_s * 1000 // max(first_ms, 1e-6))))


def _measure_cpu(fn, reps: int, budget_s: float) -> Timing:
    samples = []
    while not samples or len(samples) < _reps_within(samples[0], reps, budget_s):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return Timing(statistics.median(samples), len(samples), None)


def _measure_cuda(fn, device: torch.device, reps: int, budget_s: float) -> Timing:
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    samples = [_timed_call(fn, flush, device)]
    pairs = [_queued_call(fn, flush) for _ in range(_reps_within(samples[0], reps, budget_s) - 1)]
    torch.cuda.synchronize(device)
    samples += [start.elapsed_time(end) for start, end in pairs]
    # The flush buffer is alive for the whole window, so it adds exactly its size to the peak.
    peak = (torch.cuda.max_memory_allocated(device) - flush.numel()) / 1e9
    return Timing(statistics.median(samples), len(samples), peak)


def _queued_call(fn, flush: torch.Tensor):
    """Queues one flushed, event-bracketed call without waiting for it; returns its (start, end) events."""
    flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return start, end


def _timed_call(fn, flush: torch.Tensor, device: torch.device) -> float:
    start, end = _queued_call(fn, flush)
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` as the replay of a captured CUDA graph: the same kernels on the same tensors, without Python or
    launch overhead, as serving engines run decode steps. ``fn`` runs once on a side stream (warm-up, as capture
    requires), then once under capture; it must not synchronise with the host. Its outputs live in the graph's
    memory, overwritten by each replay.

    The replay holds ``fn``: a graph reads its inputs at the addresses captured, and keeps none of them alive.
    Before session 34 the bench's decode rows handed over a step that alone held its cache (``functools.partial``
    of the op and a freshly filled cache) and kept only ``graph.replay``: the cache went back to the allocator
    while the graph still read it, free for the L2 flush buffer allocated next (a probe that captured two such
    steps faulted with an illegal address; the bench's decode times did not change once the cache was held)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        graph.replay()

    replay.captured = fn  # what the graph reads stays alive while the replay does
    return replay
