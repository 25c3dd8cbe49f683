"""The CPU reference handles 16K tokens without a T x T tensor: peak memory stays far below one."""
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
