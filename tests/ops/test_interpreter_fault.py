"""Triton's interpreter before 3.7 cannot run with numpy 2.4 or later: the kernels refuse it with a reason that says
what to install, instead of the interpreter's opaque TypeError."""
import pytest
import torch

from sieve_attn import sfa_attention
from sieve_attn.ops import triton_common
from sieve_attn.ops.triton_common import interpreter_fault


@pytest.mark.parametrize("triton_version, numpy_version, faulty", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.4.0rc1", True), ("3.5.1", "2.10.0", True),
    ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False), ("3.9.0+git1a2b", "2.4.6", False),
    ("3.10.0", "3.0.0", False), ("2.3.1", "1.26.4", False),
])
def test_interpreter_fault_by_versions(triton_version, numpy_version, faulty):
    fault = interpreter_fault(triton_version, numpy_version)
    if faulty:
        assert triton_version in fault and numpy_version in fault and "numpy<2.4" in fault
    else:
        assert fault is None


def test_explicit_triton_backend_names_the_fault(monkeypatch):
    pytest.importorskip("triton")
    import numpy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_common.triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    q = k = v = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"backend.*Triton 3\.6\.0's interpreter cannot run with numpy 2\.4\.1"):
        sfa_attention(q, k, v, topk=4, backend="triton")
