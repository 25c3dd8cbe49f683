"""Real text offline: Python's standard-library sources (split by file into training and held-out sets, plus the
library's packages and test suite as more training text of the same kind) and any text file or folder a user names.
Text becomes fixed-length windows of token ids."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from .._checks import check_int

# Held out from training, by file. argparse.py is the file the dense baseline perplexities are quoted on.
HELD_OUT_STDLIB = ("argparse.py", "typing.py", "tarfile.py", "subprocess.py", "pathlib.py", "inspect.py")
# Prose, out of the training domain; present on Debian systems.
GPL3 = Path("/usr/share/common-licenses/GPL-3")
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ""}
# Folders of the standard library that are not its own source text: installed third-party packages, and the codecs'
# generated character-map tables (encodings/cp1252.py and the like: mostly escaped byte strings).
_NOT_STDLIB_TEXT = {"site-packages", "dist-packages", "__pycache__", "encodings"}
_TEST_FOLDERS = {"test", "tests", "idle_test"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) among the top-level modules of the standard library; disjoint by file."""
    files = sorted(p for p in stdlib_dir().glob("*.py") if p.is_file())
    held = [p for p in files if p.name in HELD_OUT_STDLIB]
    train = [p for p in files if p.name not in HELD_OUT_STDLIB]
    return train, held


def stdlib_more(tests: bool) -> list[Path]:
    """More training text of the held-out files' kind: the ``.py`` files in the standard library's folders (its
    packages, ``tests=False``) or in its test suites (``tests=True``: the ``test``, ``tests`` and ``idle_test``
    folders), sorted. Disjoint from :func:`stdlib_split` (its files are the top-level modules), and no path names a
    held-out module (``test_typing.py``, a ``pathlib`` package in newer Pythons): those are left out, so nothing
    trains on the held-out modules' source or on their tests."""
    root = stdlib_dir()
    held_stems = [name.removesuffix(".py") for name in HELD_OUT_STDLIB]
    # Installed packages are skipped before the walk: a base Python's site-packages may hold far more than the
    # library itself.
    folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name not in _NOT_STDLIB_TEXT)
    files = []
    for path in sorted(path for folder in folders for path in folder.rglob("*.py")):
        parts = path.relative_to(root).parts
        if _NOT_STDLIB_TEXT.intersection(parts) or any(stem in part for part in parts for stem in held_stems):
            continue
        if _TEST_FOLDERS.isdisjoint(parts[:-1]) != tests:
            files.append(path)
    return files


def text_files(path) -> list[Path]:
    """A file, or every text file under a folder (sorted, recursive; a file or folder whose name starts with "."
    below it is skipped: a repository's ``.git`` holds binary objects with no suffix)."""
    if not str(path):
        # Path("") is the working directory: every text file under it would be read.
        raise ValueError("text: expected a file or folder, got ''")
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"text: expected an existing file or folder, got {str(path)!r}")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ValueError(f"text: expected a folder holding text files, got {str(path)!r} with none")
    return files


def token_windows(tokenizer, files, context: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [N, context] of the files' tokens, files joined by the EOS token, in order.

    Tokenises only as many files as the windows need. The tail shorter than ``context`` is dropped, so there may be
    fewer than ``max_windows`` windows (at least one: too little text raises ValueError). Files are read as UTF-8
    (undecodable bytes replaced), whatever the machine's locale, so the same text gives the same windows anywhere.
    """
    context = check_int("context", context, 1)
    if max_windows is not None:
        max_windows = check_int("max_windows", max_windows, 1)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    need = None if max_windows is None else max_windows * context
    for path in files:
        ids.extend(tokenizer(read_text(path))["input_ids"])
        if eos is not None:
            ids.append(eos)
        if need is not None and len(ids) >= need:
            break
    count = len(ids) // context if need is None else min(len(ids) // context, max_windows)
    if count == 0:
        raise ValueError(f"text: expected at least {context} tokens, got {len(ids)}")
    return torch.tensor(ids[: count * context]).view(count, context)


def hold_back(tokenizer, files, context: int, windows: int) -> tuple[list[Path], torch.Tensor]:
    """Splits training text by file into (files to train on, validation windows [windows, context]): files are taken
    from the end of ``files`` until their tokens fill ``windows`` windows, and are then not trained on (early
    stopping must not select on text the model trains on, nor on the text it is finally scored on)."""
    windows = check_int("validation_windows", windows, 1)
    files = [Path(p) for p in files]
    need, tokens, cut = windows * context, 0, len(files)
    while tokens < need and cut > 0:
        cut -= 1
        tokens += len(tokenizer(read_text(files[cut]))["input_ids"])
        tokens += tokenizer.eos_token_id is not None  # token_windows joins files with it
    # A file named twice (a folder and a file in it) is held back wherever it also stands among the rest.
    held = {path.resolve() for path in files[cut:]}
    train = [path for path in files[:cut] if path.resolve() not in held]
    if tokens < need or not train:
        raise ValueError(f"validation_windows: expected fewer windows than the training text holds, held back by "
                         f"file ({windows} x {context} tokens leave none of its {len(files)} files to train on), "
                         f"got {windows}")
    return train, token_windows(tokenizer, files[cut:], context, windows)


def read_text(path) -> str:
    """The text of a file read as UTF-8, undecodable bytes replaced (not the locale's encoding: the tokens must not
    depend on the machine)."""
    return Path(path).read_text(encoding="utf-8", errors="replace")
