"""FlexAttention form of the decomposition (backend="flex") against the fp64 reference, with FlashAttention's rule
(tests/ops/test_focus_sdpa.py). FlexAttention has no CPU backward: on the CPU the output alone is checked (eager
FlexAttention), on a GPU out, dq, dk and dv (compiled)."""
from __future__ import annotations

import pytest
import torch

from sieve_attn.ops.focus.attention import focus_attention, focus_backend

try:
    from tests.ops.test_focus_sdpa import CASES, DEVICE, F32, SPREAD, check_against_reference, make_groups
except ImportError:  # pytest imported the test modules with tests/ on the path
    from ops.test_focus_sdpa import CASES, DEVICE, F32, SPREAD, check_against_reference, make_groups
try:
    from tests.backends import runs_backend
except ImportError:  # pytest imported the test modules with tests/ on the path
    from backends import runs_backend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# A few of the sdpa cases (eager FlexAttention is slow on the CPU), and one with softcap (a score_mod here)
FLEX_CASES = {name: CASES[name] for name in ("gqa-top2-sink", "gqa-top1-noncausal-empty-groups", "window0-bf16-top2")}
FLEX_CASES["mqa-top2-noncausal-softcap"] = (1, 3, 1, 45, 16, 5, 2, 3, False, 5.0, F32)


@pytest.mark.parametrize("case", FLEX_CASES)
def test_matches_reference(case):
    check_against_reference(case, FLEX_CASES[case], "flex", SPREAD.get(case, 1), grads=DEVICE == "cuda")


def test_short_sequences_with_gqa_one_after_another():
    """Fewer than 128 query rows times a GQA ratio of 2 past 128: torch 2.11 routed these to its FlexAttention
    decoding kernel and found no tiling for it on CUDA; new lengths one after another also recompile."""
    for length in (33, 70, 101):
        spec = (1, 4, 2, length, 16, 4, 1, 5, True, None, F32)
        check_against_reference(f"length {length}", spec, "flex", grads=DEVICE == "cuda", sink=False, seed=length)


def test_returns_lse_of_the_reference():
    q, k, v = (torch.randn(2, 4, 37, 16, generator=torch.Generator().manual_seed(s)).to(DEVICE) for s in range(3))
    groups = make_groups(2, 37, 4, 2, seed=5)
    with torch.no_grad():
        _, ref_lse = focus_attention(q.double(), k.double(), v.double(), groups, window=6, backend="reference",
                                     return_lse=True)
        with runs_backend("focus", "flex"):
            _, lse = focus_attention(q, k, v, groups, window=6, backend="flex", return_lse=True)
    assert lse.dtype == torch.float32 and (lse.double() - ref_lse).abs().max() < 1e-5


def test_explicit_flex_refuses_what_it_cannot_compute():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    groups = torch.zeros(1, 8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="backend: .*group ids < 63"):
        focus_attention(q, q, q, groups + 63, backend="flex")
    with pytest.raises(ValueError, match="backend: .*takes no attn_mask"):
        focus_attention(q, q, q, groups, backend="flex",
                        attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="backend: .*Tq == Tk"):
        focus_attention(q[:, :, :3], q, q, groups, backend="flex")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="backend: .*no gradients on the CPU"):
            focus_attention(q.requires_grad_(), q, q, groups, backend="flex")
        v = q.detach().clone().requires_grad_()  # gradients asked of v alone: focus_backend must say the same
        with pytest.raises(ValueError, match="backend: .*no gradients on the CPU"):
            focus_backend(q.detach(), q.detach(), groups, backend="flex", v=v)
    assert focus_backend(q.detach(), q.detach(), groups, backend="flex") == ("flex", "requested")
