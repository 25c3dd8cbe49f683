"""Atomic file writes: a crash mid-write leaves the previous file intact."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path, write) -> None:
    """Calls ``write(tmp)`` on a temporary file in ``path``'s folder (created if missing), then renames it to
    ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
