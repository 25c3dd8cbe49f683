"""How many programs of each decode kernel :func:`sieve_attn.ops.split_k.programs_per_sm` finds an H100's SM holds,
asked on a machine without a GPU, through Triton's own JIT path: ``python -m tests.ops.sm90_occupancy`` prints
JSON, one entry per decode step it runs: {"kernel", "head_dim", "topk" (SFA; null for Focus), "wanted", "held"}.

Why: on a GPU the decode steps ask Triton's ``warmup`` for the compiled kernel and read its shared memory and
registers (``_init_handles``); CPU CI runs the kernels in the interpreter, where that path is skipped. Here it runs
as on the GPU: the step builds its real arguments and launch options, ``warmup`` binds and specialises them and
compiles the kernel for sm_90 with the ptxas of Triton's wheel. Stubbed, since there is no GPU: Triton's driver
(current device 0 and its stream, an sm_90 target, the launcher, and the binary load, whose register count is read
from the cubin with the wheel's cuobjdump, as the CUDA driver reports it) and torch's device properties (an H100:
233472 bytes of shared memory, 65536 registers and 2048 threads an SM). The step stops after its plan, before the
launch; the decode options are a Hopper GPU's (TMA tiles of V, programmatic dependent launch). Run where the kernels
are compiled rather than interpreted (TRITON_INTERPRET unset).
"""
from __future__ import annotations

import json
import re
import subprocess
import tempfile
import types
from functools import partial
from pathlib import Path

import torch

H100 = types.SimpleNamespace(name="stub H100", major=9, minor=0, multi_processor_count=132,
                             shared_memory_per_multiprocessor=233472, regs_per_multiprocessor=65536,
                             max_threads_per_multi_processor=2048)
# SFA's (head dim, topk) and Focus's head dims to ask about (a cold compile of SFA's kernel takes 20-70 s on 2 CPU
# cores, more the larger topk: topk = 24 is left to the arithmetic's test).
SFA_CONFIGS = [(128, 16), (128, 20)]
FOCUS_HEAD_DIMS = [128]


class _PlanMade(Exception):
    """Raised once the step has its plan: nothing is launched without a GPU."""


def _registers(cubin: bytes) -> int:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", file.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def _stub_gpu() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Utils:
        @staticmethod
        def get_device_properties(device):
            return dict(max_shared_mem=227 * 1024, multiprocessor_count=H100.multi_processor_count,
                        max_num_regs=H100.regs_per_multiprocessor, warpSize=32)

        @staticmethod
        def load_binary(name, binary, shared, device):  # module, function, registers, spills, max threads
            return object(), object(), _registers(binary), 0, 1024

    class Driver:
        utils = Utils()

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def launcher_cls(self, src, metadata):
            return None

    driver.set_active(Driver())
    torch.cuda.get_device_properties = lambda device=None: H100


def main() -> list[dict]:
    _stub_gpu()
    from sieve_attn.ops import split_k
    from sieve_attn.ops.focus import decode as focus_decode
    from sieve_attn.ops.sfa import decode as sfa_decode
    from sieve_attn.ops.sfa.cache import SFAKeyCache

    sfa_decode.hopper_or_newer = lambda device: True
    found, programs_per_sm = [], split_k.programs_per_sm

    def asked(kernel, args, options, device, wanted):
        held = programs_per_sm(kernel, args, options, torch.device("cuda", 0), wanted)
        found.append(dict(kernel=kernel.fn.__name__, head_dim=options["HEAD_DIM"], topk=options.get("TOPK"),
                          wanted=wanted, held=held))
        raise _PlanMade

    split_k.programs_per_sm = asked
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, length = 1, 32, 8, 256

    def tensor(heads, tokens, head_dim):
        return torch.randn(batch, heads, tokens, head_dim, generator=gen).to(torch.bfloat16)

    steps = []  # (head dim, step(q))
    for head_dim, topk in SFA_CONFIGS:
        cache = SFAKeyCache(batch, kv_heads, head_dim, topk=topk, dtype=torch.bfloat16)
        cache.append(tensor(kv_heads, length, head_dim), tensor(kv_heads, length, head_dim))
        steps.append((head_dim, partial(sfa_decode.sfa_decode_triton, cache=cache, scale=head_dim ** -0.5)))
    for head_dim in FOCUS_HEAD_DIMS:
        k, v = tensor(kv_heads, length, head_dim), tensor(kv_heads, length, head_dim)
        bits = torch.ones(batch, length, dtype=torch.int64)
        steps.append((head_dim, partial(focus_decode.focus_decode, k=k, v=v, bits=bits, window=64,
                                        scale=head_dim ** -0.5)))
    for head_dim, step in steps:
        try:
            step(tensor(q_heads, 1, head_dim))
        except _PlanMade:
            pass
    return found


if __name__ == "__main__":
    print(json.dumps(main()))
