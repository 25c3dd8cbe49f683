"""Work queued on a second CUDA stream, so that the device runs it while the current stream waits for the host.

The decomposition backend queues the window kernel this way before it sorts the layouts: the sorting is many small
launches and one read of its sizes per layout, during which the current stream would otherwise idle, and those
reads must not wait for the window kernel.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device=device_index)


class SideStream:
    """A context in which :meth:`run` queues work on a side stream of ``device`` (CUDA), after the work already
    queued on the current stream when the context was entered. :meth:`join` (and the context's exit, normal or by an
    exception) makes the current stream wait for all of it, so no input it reads is freed and reused under it while
    the caller holds that input until then.

    What the side work writes must be allocated before :meth:`run`, on the current stream: blocks allocated on the
    side stream would return to its own pool when freed, out of the current stream's reach. Off CUDA, :meth:`run`
    calls at once and :meth:`join` does nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.main = self.side = None

    def __enter__(self) -> "SideStream":
        if self.device.type == "cuda":
            self.main = torch.cuda.current_stream(self.device)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.side = _side_stream(index)
            self.side.wait_stream(self.main)
        return self

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        if self.side is None:
            return fn(*args, **kwargs)
        with torch.cuda.stream(self.side):
            return fn(*args, **kwargs)

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)

    def __exit__(self, *exc) -> None:
        self.join()
