"""Atomic training checkpoints: a crash mid-write leaves the previous checkpoint intact."""
from __future__ import annotations

from pathlib import Path

import torch

from .._files import atomic_write


def save_checkpoint(state: dict, path) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path) -> dict | None:
    path = Path(path)
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
