"""Which code produced a result: the git commit of the checkout the package runs from, and a digest of the
package's sources, which names the code where the commit cannot (a copy of the tree whose git metadata is stale, an
installed package)."""
from __future__ import annotations

import hashlib
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch


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


def source_digest(root: Optional[Path] = None) -> str:
    """"sha256:HEX" over the package's Python sources (default: the folder of this file): each ``.py`` file's path
    relative to ``root`` and its bytes, in sorted path order. Two trees with the same sources give the same digest
    whatever git says of them and wherever they lie; ``python -c "from sieve_attn._provenance import source_digest
    as d; print(d())"`` in a checkout of a commit gives that commit's. Every ``.py`` file counts, tracked or not, and
    its bytes as stored (a checkout that rewrites line endings gives another digest)."""
    root = Path(__file__).parent if root is None else Path(root)
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


def environment(device="cpu") -> dict:
    """What a recorded result ran on and with: ``device``'s name (the GPU's, or the CPU's), the versions of Python,
    torch, Triton, transformers, CUDA and cuDNN (None where absent or unused), torch's CPU threads, whether float32
    matmuls may use TF32, the commit and the source digest."""
    device = torch.device(device)
    cuda = device.type == "cuda"

    def version(module: str) -> Optional[str]:
        try:
            return __import__(module).__version__
        except ImportError:
            return None
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "python": platform.python_version(), "torch": torch.__version__, "triton": version("triton"),
            "transformers": version("transformers"), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "threads": torch.get_num_threads(),
            # TF32 matmuls for float32 (torch.backends.cuda.matmul.allow_tf32, or TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1)
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "commit": git_commit(),
            "source_digest": source_digest()}
