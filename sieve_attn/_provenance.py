"""Which code produced a result: the git commit of the checkout the package runs from."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional


def git_commit(short: bool = False) -> Optional[str]:
    """HEAD of the checkout this package runs from, with ``-dirty`` appended when tracked files differ from it (a run
    of uncommitted code must not pass for the commit's) and ``-unchecked`` when git could not tell; None outside a
    git checkout or without git."""
    here = Path(__file__).parent

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=here)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", *(["--short"] if short else []), "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    if changes is None:
        return commit + "-unchecked"
    return commit + "-dirty" if changes else commit
