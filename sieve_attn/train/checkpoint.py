"""Atomic training checkpoints (a crash mid-write leaves the previous checkpoint intact), and the digests they record
of what a resumed run must share."""
from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import torch

from .._checks import fail
from .._files import atomic_write


def save_checkpoint(state: dict, path) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path) -> dict | None:
    """The checkpoint at ``path`` (tensors on the CPU), or None when there is none.

    Its tensors are memory-mapped, copy-on-write (the file never changes): under a launcher every process opens the
    checkpoint, and the processes share the pages they read instead of each holding a private copy of a fine-tuned
    model's weights and optimizer state. A tensor that stays in use on the CPU (a CPU run's optimizer state after
    resuming) keeps this version of the file mapped, and its disk space held, until it is freed.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:  # truncated, not a zip
        fail("out_dir", "a checkpoint a sieve run wrote whole", f"{path}, which cannot be read ({error}); delete it "
             "to start over")


def sampled_digest(tensors: dict[str, torch.Tensor], samples: int = 4096) -> str:
    """:func:`tensors_digest` of up to ``samples`` evenly spaced elements of each tensor: a fingerprint of a
    model's weights that costs little at any size and tells apart weights that training changed broadly (a base
    model and its fine-tunes), though not two that differ in a few elements only."""
    sampled = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().reshape(-1)
        sampled[name] = flat[::max(1, flat.numel() // samples)][:samples]
    return tensors_digest(sampled)


def layout_digest(tensors: dict[str, torch.Tensor]) -> str:
    """"sha256:HEX" (16 hex digits) of named tensors' names, shapes and dtypes, in order, not their values: what a
    checkpoint's tensors must match to load into a model."""
    layout = "\n".join(f"{name} {tuple(tensor.shape)} {tensor.dtype}" for name, tensor in tensors.items())
    return f"sha256:{hashlib.sha256(layout.encode()).hexdigest()[:16]}"


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """"sha256:HEX" (16 hex digits) of named tensors: their names, shapes, dtypes and bytes, in order."""
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()[:16]}"
