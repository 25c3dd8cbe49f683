"""Proof that a call ran the backend it names. A backend that fell through to another (the reference, say) agrees
with the reference too, so a test of a fast path checks that the path's function was called."""
from __future__ import annotations

import contextlib
import importlib

import pytest

# The function each fast backend computes with, where the op's dispatch calls it: (module, function). The Triton
# entry points are imported by the ops at call time, so patching their modules reaches the call.
BACKEND_FUNCTIONS = {
    ("focus", "sdpa"): ("sieve_attn.ops.focus.attention", "focus_attention_sdpa"),
    ("focus", "flex"): ("sieve_attn.ops.focus.attention", "focus_attention_flex"),
    ("focus", "triton"): ("sieve_attn.ops.focus.triton_prefill", "focus_attention_triton"),
    ("sfa", "sdpa"): ("sieve_attn.ops.sfa.attention", "sfa_attention_sdpa"),
    ("sfa", "triton"): ("sieve_attn.ops.sfa.flash_sfa", "flash_sfa_attention"),
}


@contextlib.contextmanager
def runs_backend(op: str, backend: str):
    """Within the block, calls of ``op``'s (``"focus"`` or ``"sfa"``) prefill ``backend`` function are counted;
    leaving it fails unless there was at least one. ``backend`` must be one of :data:`BACKEND_FUNCTIONS`' (the
    reference and Focus's dense backend are what the fast paths are checked against)."""
    module_name, name = BACKEND_FUNCTIONS[(op, backend)]
    module = importlib.import_module(module_name)
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, name, counted)
        yield
    assert calls, f"{op} backend {backend!r} did not run: {module_name}.{name} was never called"
