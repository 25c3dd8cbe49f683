"""The CPU reference handles long sequences without a T x T tensor: peak memory stays far below one."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import resource, torch
    import sieve_attn as sa
    torch.manual_seed(0)
    T = 16384
    q = torch.randn(1, 2, T, 16)
    k = torch.randn(1, 1, T, 16)
    v = torch.randn(1, 1, T, 16)
    groups = torch.rand(1, T, 8).argsort(dim=-1)[..., :2]  # two distinct groups of 8 per token
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = sa.focus_attention(q, k, v, groups, window=128)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(out).all()
    print((after - before) * 1024)
""")


def test_focus_attention_16k_tokens_without_a_t_by_t_tensor():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    grown = int(result.stdout.strip().splitlines()[-1])
    t_by_t_bool = 16384 * 16384  # one byte per pair: the smallest T x T tensor there is (256 MiB)
    assert grown < t_by_t_bool, f"peak memory grew by {grown / 2**20:.0f} MiB during the call"


SOFT_SCRIPT = textwrap.dedent("""
    import resource, torch
    import sieve_attn as sa
    torch.manual_seed(0)
    T = 12288  # above the size from which blocks are recomputed in backward rather than kept
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))  # a frozen model's: no gradient
    assign = torch.rand(1, T, 4).softmax(-1).requires_grad_()  # the router's memberships: gradient
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = sa.focus_soft_attention(q, k, v, assign, window=128)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.sum().backward()
    assert torch.isfinite(assign.grad).all() and assign.grad.abs().sum() > 0
    print((after - before) * 1024)
""")


def test_soft_attention_keeps_no_score_blocks_when_only_the_memberships_need_gradients():
    """Retrofit's first layer: q, k, v need no gradient but the soft gate's memberships do; the forward must not
    keep every block's scores for backward. Kept, the float32 scores of both heads alone are 2 x T x T x 4 bytes
    (1.2 GB at 12K tokens), and the gate keeps several such tensors; recomputed, only one block's temporaries
    (about 170 queries x T) and the allocator's slack remain."""
    result = subprocess.run([sys.executable, "-c", SOFT_SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    grown = int(result.stdout.strip().splitlines()[-1])
    assert grown < 2 * 12288 * 12288 * 4, f"peak memory grew by {grown / 2**20:.0f} MiB during the forward"
