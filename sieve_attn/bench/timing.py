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


@dataclass(frozen=True)
class Timing:
    """Median milliseconds over ``reps`` timed calls, and the peak GPU memory (GB, 1e9 bytes) while they ran, inputs
    included, the L2 flush buffer excluded (None on the CPU)."""
    ms: float
    reps: int
    peak_gb: Optional[float]


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10,
            budget_s: float = 2.0) -> Timing:
    """Times ``fn()``: ``warmup`` untimed calls, then up to ``reps`` timed ones.

    The first timed call sets how many follow: as many as fit in ``budget_s`` (at least that one), so a call of
    several seconds is timed once. Its return value is dropped at once, so outputs do not pile up in the peak.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        return _measure_cuda(fn, device, reps, budget_s)
    return _measure_cpu(fn, reps, budget_s)


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
    memory, overwritten by each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
