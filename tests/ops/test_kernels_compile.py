"""Every Triton kernel the library launches compiles for a Hopper GPU (sm_90), checked on a machine without one.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler does not; here each op runs
once under the interpreter (bfloat16 and float32, GQA, causal, forward and backward where it has one, with the
tiles, warps and stages the prefill kernels take on a GPU) while :func:`.gpu_compile.record_launches` notes its
launches, and a second process, where the kernels are compiled rather than interpreted, compiles them for sm_90
and checks that each fits an sm_90 block's shared memory (:func:`.gpu_compile.compile_launches`; what differs from
a GPU's launch is said there). On a CUDA machine the kernels are compiled for the local GPU by every other test, so this
one is for CPU CI only.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")
from sieve_attn.ops.focus import segments as group_sort  # noqa: E402
from sieve_attn.ops.focus import triton_prefill as focus_prefill  # noqa: E402
from sieve_attn.ops.focus.attention import focus_attention  # noqa: E402
from sieve_attn.ops.focus.decode import focus_decode  # noqa: E402
from sieve_attn.ops.focus.reference import group_bits  # noqa: E402
from sieve_attn.ops.gather import gather_rows_triton  # noqa: E402
from sieve_attn.ops.magnitude import largest_magnitudes_triton  # noqa: E402
from sieve_attn.ops.merge import merge_indexed_triton  # noqa: E402
from sieve_attn.ops.sfa import flash_sfa  # noqa: E402
from sieve_attn.ops.sfa.attention import sfa_attention  # noqa: E402
from sieve_attn.ops.sfa.cache import SFAKeyCache  # noqa: E402
from sieve_attn.ops.sfa.decode import sfa_decode  # noqa: E402
from sieve_attn.ops.sfa.flash_sfa import dense_cuda_core_attention  # noqa: E402
from sieve_attn.ops.triton_common import is_interpreted  # noqa: E402

from .gpu_compile import record_launches  # noqa: E402

# Triton's wheels carry the NVIDIA backend and its ptxas; a build without them compiles for no GPU.
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = [pytest.mark.skipif(not is_interpreted(flash_sfa._fwd_kernel),
                                 reason="the kernels are compiled for the local GPU by the other tests"),
              pytest.mark.skipif(not PTXAS.exists(), reason=f"this Triton has no NVIDIA backend ({PTXAS} missing)")]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
REPO = Path(__file__).resolve().parents[2]


def _qkv(dtype, q_heads=4, kv_heads=2, length=40, head_dim=64, grad=False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen).to(dtype).requires_grad_(grad)
               for heads in (q_heads, kv_heads, kv_heads))
    return q, k, v


def flash_sfa_forward_and_backward(dtype):
    """FlashSFA, and the bench's like-for-like dense kernel (the same forward kernel, dense scores)."""
    q, k, v = _qkv(dtype, grad=True)
    for softcap in (None, 30.0):
        sfa_attention(q, k, v, topk=8, causal=True, softcap=softcap, backend="triton").float().sum().backward()
    with torch.no_grad():
        dense_cuda_core_attention(q, k, v, causal=True)


def sfa_decode_step(dtype):
    q, k, v = _qkv(dtype, q_heads=8, kv_heads=2, length=70, head_dim=128)
    cache = SFAKeyCache(1, 2, 128, topk=16, dtype=dtype, device=q.device)
    cache.append(k, v)
    sfa_decode(q[:, :, -1:], cache, backend="triton")


def focus_forward_and_backward(dtype):
    q, k, v = _qkv(dtype, length=70, grad=True)
    groups = torch.randint(0, 4, (1, 70), generator=torch.Generator().manual_seed(1))
    for softcap in (None, 30.0):
        focus_attention(q, k, v, groups, window=16, softcap=softcap, backend="triton").float().sum().backward()


def focus_decode_step(dtype):
    q, k, v = _qkv(dtype, q_heads=8, kv_heads=2, length=70, head_dim=128)
    groups = torch.randint(0, 4, (1, 70, 2), generator=torch.Generator().manual_seed(1))  # two memberships
    focus_decode(q[:, :, -1:], k, v, group_bits(groups), window=16, scale=128 ** -0.5)


def sdpa_backend_helpers(dtype):
    """The kernels of the sdpa backends, which serve CUDA tensors only: the sort of the tokens by group (three
    memberships per token, some slots empty), and the gather, magnitude and merge kernels."""
    ids = torch.randint(-1, 4, (1, 50, 3), generator=torch.Generator().manual_seed(2))
    ids[..., 0] = ids[..., 0].clamp(min=0)
    group_sort.start(ids, 4, False, lambda sizes: sizes.tolist).finish()
    q, k, _ = _qkv(dtype)
    gather_rows_triton(k, torch.tensor([3, -1, 7, 0]), 2, 2, factor=0.5, dtype=torch.float16)
    largest_magnitudes_triton([q, k])
    out, lse = torch.zeros(1, 4, 6, 64), torch.zeros(1, 4, 6)
    part_out, part_lse = torch.randn(2, 4, 3, 64), torch.randn(2, 4, 3)
    merge_indexed_triton(out, lse, part_out, part_lse, torch.tensor([0, 5, -1, 2, 1, 3]))


OPS = [flash_sfa_forward_and_backward, sfa_decode_step, focus_forward_and_backward, focus_decode_step,
       sdpa_backend_helpers]


@contextmanager
def gpu_tiles():
    """The prefill kernels' tilings (tile sizes, warps, stages) as on a GPU, not the interpreter's small ones."""
    cuda = torch.device("cuda")
    with mock.patch.object(flash_sfa, "tiling", lambda device, tiling=flash_sfa.tiling: tiling(cuda)), \
            mock.patch.object(focus_prefill, "tiling", lambda device, tiling=focus_prefill.tiling: tiling(cuda)):
        yield


def launched_in_the_library() -> set[tuple[str, str]]:
    """(module, kernel) of every launch written in the package's source as ``_kernel[(...)](`` or
    ``_kernel[grid](``, the forms it uses (a kernel launched through another name, or from another module than its
    own, would need this to learn that form)."""
    found = set()
    for path in (REPO / "sieve_attn").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found |= {(module, name) for name in re.findall(r"\b(_\w+)\[(?:\(|grid\]\()", path.read_text())}
    return found


@functools.cache
def launches_of(op, dtype) -> list[dict]:
    """The launches ``op`` makes at ``dtype`` with the GPU's tilings, as a GPU would specialise them (recorded once
    per module run: both tests read them)."""
    with record_launches(native_dots=dtype != torch.float32) as launches, gpu_tiles():
        op(dtype)
    return launches


def test_the_ops_here_launch_every_kernel_of_the_library():
    """So that a new kernel cannot miss the compile check: each launch in the source is among those the ops above
    make."""
    recorded = {(launch["module"], launch["name"]) for op in OPS for launch in launches_of(op, torch.bfloat16)}
    assert launched_in_the_library() - recorded == set()


def _compiling_env() -> dict:
    """This process's environment for a child that compiles the kernels (TRITON_INTERPRET unset) and imports the
    repository's packages."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op", OPS, ids=[op.__name__ for op in OPS])
def test_every_kernel_the_op_launches_compiles_for_sm90(op, dtype):
    launches = launches_of(op, dtype)
    assert launches, f"{op.__name__} launched no Triton kernel"
    compiled = subprocess.run([sys.executable, "-m", "tests.ops.gpu_compile"], input=json.dumps(launches),
                              capture_output=True, text=True, env=_compiling_env(), cwd=REPO, timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert compiled.stdout == "", f"{len(launches)} launches, these would fail on an sm_90 GPU:\n{compiled.stdout}"


def test_decode_steps_count_the_programs_an_sm_holds_through_tritons_jit():
    """The decode steps' occupancy query (:func:`sieve_attn.ops.split_k.programs_per_sm`), run as on a GPU through
    Triton's warmup and compiled kernel, with only the driver's device and binary load stubbed
    (:mod:`.sm90_occupancy`): SFA at D = 128 keeps its 8 programs an SM at topk = 16, where its compiled kernel
    fits 8, and plans fewer at topk = 20, whose shared memory holds fewer (7 with Triton 3.6 and 3.9); Focus keeps
    its 3."""
    found = subprocess.run([sys.executable, "-m", "tests.ops.sm90_occupancy"], capture_output=True, text=True,
                           env=_compiling_env(), cwd=REPO, timeout=900)
    assert found.returncode == 0, found.stderr[-3000:]
    held = {(entry["kernel"], entry["head_dim"], entry["topk"]): (entry["wanted"], entry["held"])
            for entry in json.loads(found.stdout)}
    assert held[("_sfa_decode_chunk", 128, 16)] == (8, 8)
    wanted, fewer = held[("_sfa_decode_chunk", 128, 20)]
    assert wanted == 8 and 1 <= fewer < 8
    assert held[("_focus_decode_chunk", 128, None)] == (3, 3)
