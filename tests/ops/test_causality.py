"""No future token reaches a past output, in every fast prefill path (Focus triton, sdpa, flex; SFA triton, sdpa).

Matching the causal reference bounds a leak only by the tolerance; here the inputs of the tokens from ``cut`` on are
replaced by others (q, k, v and, for Focus, their groups), and the outputs before ``cut`` must stay as they were,
to float32 rounding of another tiling at most (a leak of a replaced token moves them by far more). The gradients of
a loss on those outputs alone must be exactly 0 at every replaced token's q, k and v: every pair they would enter
has a zero output gradient or lies in the future.
"""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops.focus.attention import focus_attention
from sieve_attn.ops.sfa.attention import sfa_attention

try:
    from tests.ops.test_focus_sdpa import DEVICE, make_groups
except ImportError:  # pytest imported the test modules with tests/ on the path
    from ops.test_focus_sdpa import DEVICE, make_groups
try:
    from tests.backends import runs_backend
except ImportError:  # pytest imported the test modules with tests/ on the path
    from backends import runs_backend

# The Triton backward kernels exponentiate a tile's logits before masking it (tl.where then drops the masked
# entries): with the large replaced inputs a masked future pair overflows to inf there, which numpy warns of.
pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")]

LENGTH, CUT = 70, 41  # the cut inside a 64-row tile, past the first: tiles that hold both sides are the hard case
# Outputs before the cut may move by float32 rounding where the layout changes (the sdpa backend sorts by group,
# so another group draw for the later tokens re-tiles the earlier ones); a leak moves them by about 1e-2 or more.
ROUNDING = 1e-5


def _inputs(q_heads, kv_heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, LENGTH, dim, generator=gen).to(DEVICE) for heads in (q_heads, kv_heads, kv_heads)]


def _replace_future(tensors, seed, scale=10.0):
    """Copies of [B, H, T, ...] tensors whose tokens from CUT on are redrawn (larger, so a leak cannot hide)."""
    gen = torch.Generator().manual_seed(seed)
    replaced = []
    for t in tensors:
        t = t.clone()
        t[:, :, CUT:] = scale * torch.randn(t[:, :, CUT:].shape, generator=gen).to(t.device)
        replaced.append(t)
    return replaced


def _check_causal(attend, inputs, replaced, grads=True):
    """attend(q, k, v, which) -> out, with ``which`` 0 for the original inputs and 1 for the replaced ones."""
    with torch.no_grad():
        before = attend(*inputs, 0)[:, :, :CUT]
        after = attend(*replaced, 1)[:, :, :CUT]
    assert not torch.isnan(after).any()
    assert (after - before).abs().max().item() <= ROUNDING
    if not grads:
        return
    leaves = [t.detach().clone().requires_grad_() for t in replaced]
    out = attend(*leaves, 1)
    weight = torch.linspace(-1, 1, out[:, :, :CUT].numel(), device=out.device).view(out[:, :, :CUT].shape)
    (out[:, :, :CUT] * weight).sum().backward()
    for name, leaf in zip("qkv", leaves):
        assert torch.count_nonzero(leaf.grad[:, :, CUT:]) == 0, f"d{name} of a future token"
        assert torch.count_nonzero(leaf.grad[:, :, :CUT]) > 0, f"d{name}: no gradient at all"


# (q heads, kv heads, head dim, groups, memberships, window)
FOCUS_CASES = {"gqa-top1": (4, 2, 16, 4, 1, 5), "mqa-top2": (3, 1, 16, 5, 2, 7)}


@pytest.mark.parametrize("backend", ["triton", "sdpa", "flex"])
@pytest.mark.parametrize("case", FOCUS_CASES)
def test_focus_fast_paths_are_causal(backend, case):
    q_heads, kv_heads, dim, num_groups, slots, window = FOCUS_CASES[case]
    groups = make_groups(1, LENGTH, num_groups, slots, seed=1, sink=False)
    later = make_groups(1, LENGTH, num_groups, slots, seed=2, sink=False)
    future_groups = torch.cat([groups[:, :CUT], later[:, CUT:]], dim=1)

    def attend(q, k, v, which):
        return focus_attention(q, k, v, (groups, future_groups)[which], window=window, causal=True, backend=backend)

    inputs = _inputs(q_heads, kv_heads, dim, seed=3)
    with runs_backend("focus", backend):  # FlexAttention has no backward on the CPU
        _check_causal(attend, inputs, _replace_future(inputs, seed=4), grads=backend != "flex" or DEVICE == "cuda")


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("q_heads, kv_heads, dim, topk", [(4, 2, 32, 5), (2, 1, 64, 16)])
def test_sfa_fast_paths_are_causal(backend, q_heads, kv_heads, dim, topk):
    def attend(q, k, v, which):
        return sfa_attention(q, k, v, topk=topk, causal=True, backend=backend)

    inputs = _inputs(q_heads, kv_heads, dim, seed=5)
    with runs_backend("sfa", backend):
        _check_causal(attend, inputs, _replace_future(inputs, seed=6))
