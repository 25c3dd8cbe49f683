"""One SFA decode step of the working tree at 128K, k=16, GQA 32/8, D=128, bf16, for ncu (v9, session 25)."""
import torch
from sieve_attn import skip_nan_checks
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.decode import sfa_decode_triton

torch.manual_seed(0)
T = 128 * 1024
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cache = SFAKeyCache(1, 8, 128, topk=16, dtype=torch.bfloat16, device="cuda", capacity=T)
cache.append(k, v)
with skip_nan_checks():
    for _ in range(3):
        sfa_decode_triton(q, cache, scale=128 ** -0.5)
torch.cuda.synchronize()
