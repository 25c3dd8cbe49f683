"""Test session setup: without CUDA, the Triton kernels run in Triton's interpreter.

Triton picks the interpreter when a kernel is decorated, i.e. when its module is first imported, so the variable is
set here, before any test module imports a kernel.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
