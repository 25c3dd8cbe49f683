"""Atomic training checkpoints: a crash mid-write leaves the previous checkpoint intact."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def save_checkpoint(state: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path) -> dict | None:
    path = Path(path)
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
