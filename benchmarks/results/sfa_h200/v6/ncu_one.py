"""One SFA decode step at 128K, k=16, GQA 32/8, D=128 for ncu: argv[1] = v6 (the working tree) or v4 (HEAD)."""
import importlib.util, sys
import torch
from sieve_attn import skip_nan_checks
from sieve_attn.ops.sfa import decode as new
from sieve_attn.ops.sfa.cache import SFAKeyCache
if sys.argv[1] == "v4":
    spec = importlib.util.spec_from_file_location("sieve_attn.ops.sfa.decode_v4", "scratch/old/decode_v4.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
else:
    mod = new
torch.manual_seed(0)
T = 128 * 1024
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cache = SFAKeyCache(1, 8, 128, topk=16, dtype=torch.bfloat16, device="cuda", capacity=T)
cache.append(k, v)
with skip_nan_checks():
    for _ in range(3):
        mod.sfa_decode_triton(q, cache, scale=128 ** -0.5)
torch.cuda.synchronize()
