"""Test session setup: without CUDA, the Triton kernels run in Triton's interpreter (the run stops at once where the
installed Triton and numpy cannot run it); every test runs with poisoned allocations (:func:`poisoned_allocations`).

Triton picks the interpreter when a kernel is decorated, i.e. when its module is first imported, so the variable is
set here, before any test module imports a kernel.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Stops the run at once where the interpreter is on but cannot run the kernels (an old Triton with a new
    numpy): every interpreted kernel test would fail with the same opaque error."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from sieve_attn.ops.triton_common import interpreter_fault, triton

    fault = triton is not None and interpreter_fault()
    if fault:
        pytest.exit(f"the Triton kernel tests cannot run: {fault}", returncode=4)


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """tensor filled in place with NaN (floating dtypes) or its dtype's largest value (integer dtypes; bool is left
    as it is); returned. Filled outside autograd, so that a leaf allocated with ``requires_grad=True`` (as
    ``torch.utils.checkpoint`` and ``torch.compile`` allocate some) stays a leaf and takes the fill."""
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return :func:`poison`-ed tensors in every test.

    Why: a kernel that leaves part of a buffer unwritten, or reads a buffer before writing it, then shows NaN in what
    it returns (or an index out of range, which the interpreter refuses) instead of passing on memory that happened
    to hold zeros or an earlier result. Poisoning only the ``out`` a test passes in would miss the ops' own
    buffers, which they copy into ``out`` at the end."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *args, **kwargs: poison(new_empty(self, *args, **kwargs)))
