"""For Nsight Compute (v18, session 21): five decode steps at 128K cached tokens, GQA 32/8, D=128, K=8, top-2
(combinations groups), bf16, as the gated bench runs them; call_u.sh profiles the fourth launch of the kernel."""
import torch

from sieve_attn.bench.focus import balanced_groups
from sieve_attn.ops.focus import decode
from sieve_attn.ops.focus.reference import group_bits

dev = torch.device("cuda")
torch.manual_seed(0)
q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 131072, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
bits = group_bits(balanced_groups(131072, 8, 2, spread="combinations").to(dev))
for _ in range(5):
    decode.focus_decode(q, k, v, bits, window=128, scale=128 ** -0.5)
torch.cuda.synchronize()
