"""Atomic file writes (a crash mid-write, or a power loss after it, leaves the previous file intact), and reads of
safetensors files that say which argument gave an unreadable one."""
from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
from pathlib import Path


TOKEN_BYTES = 4  # random bytes in a temporary folder's name: .NAME.<8 hex digits>


def atomic_write(path, write) -> None:
    """Calls ``write(tmp)`` on a temporary file in a temporary folder beside ``path`` (``.NAME.<hex>/NAME``; the
    parent is created if missing), flushes it to disk and renames it to ``path``, then flushes the folder, so that
    ``path`` is the old file or the whole new one even after a power loss. The file gets the permissions a plain
    ``open`` gives (0666 less the umask), also where ``write`` replaces it with a file of its own (safetensors
    writes its own temporary file, 0600, and renames it over the one given): that temporary file then lies in the
    temporary folder too.

    Temporary folders and files of ``path`` that an earlier writer killed mid-write left behind (``.NAME.<8 hex
    digits>`` beside it) are removed first: one writer per path at a time, as every caller here writes from one
    process."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*"):
        if not re.fullmatch(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{2 * TOKEN_BYTES}}}", stale.name):
            continue  # not a name this function gives: someone else's file
        shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink(missing_ok=True)
    folder = path.parent / f".{path.name}.{secrets.token_hex(TOKEN_BYTES)}"
    folder.mkdir()
    tmp = folder / path.name
    try:
        open(tmp, "xb").close()  # created as open() creates files: the permissions the written file gets
        mode = tmp.stat().st_mode & 0o777
        write(str(tmp))
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    except (OSError, RuntimeError) as error:  # a full disk reaches torch.save's writer as a RuntimeError
        raise OSError(f"{path}: could not be written ({error}); the file there before, if any, is as it was") \
            from error
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fsync_folder(folder: Path) -> None:
    """Flushes a folder's entries (the rename) to disk, where the platform lets a folder be opened."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def read_safetensors(path, name: str) -> dict:
    """The tensors of the safetensors file at ``path`` (on the CPU); ValueError naming ``name`` (the argument that
    gave the file) when it is missing or is no whole safetensors file (truncated, another format)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{name}: expected a safetensors file, got {str(path)!r}, which cannot be read "
                         f"({error})") from None
