"""Triton building blocks shared by the attention kernels (Focus prefill and decode, SFA decode).

triton is optional (the "dev" extra; CUDA builds of torch bring it): without it this module still imports, ``jit``
returns the plain function and no kernel is ever launched.
"""
from __future__ import annotations

import math
import os

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# log2 e, which the decode kernels' callers fold into the logit scale (softmax in base 2: :func:`softmax_step`),
# and ln 2 (constexpr, so that jit functions may read it), which turns base-2 log-sum-exps back into natural ones.
LOG2E = 1 / math.log(2)
if triton is not None:
    _LN2 = tl.constexpr(math.log(2))
    # The interpreter runs no PTX.
    _PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


def on_device_of(tensor):
    """A context in which Triton launches go to ``tensor``'s CUDA device (the launcher uses the current device, and
    ``cuda:1`` tensors under a current ``cuda:0`` cannot be reached); a no-op off CUDA."""
    import contextlib

    import torch

    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def jit(fn):
    """triton.jit, or the plain function when triton is missing."""
    return fn if triton is None else triton.jit(fn)


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` runs in the Triton interpreter (TRITON_INTERPRET=1 when it was defined)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel, InterpretedFunction)


@jit
def dot(a, b, NATIVE: tl.constexpr):
    """a @ b accumulated in float32. NATIVE: tl.dot on the operands as they are (tensor cores). Otherwise exact
    float32 products: for float32 inputs, where tf32 would lose the precision asked for, and in the interpreter,
    whose 16-bit tl.dot multiplies bit patterns (triton-lang/triton#11584); products of 16-bit values are exact in
    float32, so both paths compute the same thing."""
    if NATIVE:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


def hopper_or_newer(device) -> bool:
    """Whether ``device`` is a GPU of compute capability 9 or more: one with the TMA copy engine (tensor-descriptor
    loads) and programmatic dependent launch (``launch_pdl=True``, with :func:`allow_next_kernel` and
    :func:`wait_for_prior_kernel`). Why the decode kernels launch so: a decode step is three short kernels, and
    each launch otherwise waits for the previous kernel to drain before it is scheduled."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@jit
def wait_for_prior_kernel():
    """Programmatic dependent launch: blocks until the kernel before this one on the stream has completed, its
    writes visible. A kernel launched with ``launch_pdl=True`` may be scheduled before then, and calls this before
    it reads what that kernel wrote or writes anything. A no-op for kernels launched without it, and in the
    interpreter."""
    if _PTX:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@jit
def allow_next_kernel():
    """Programmatic dependent launch: the next kernel on the stream, if launched with ``launch_pdl=True``, may be
    scheduled once every program of this one has called this or exited (it still waits for this one's completion
    before touching memory: :func:`wait_for_prior_kernel`). A no-op otherwise, and in the interpreter."""
    if _PTX:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@jit
def prefetch_l2(ptrs):
    """Asks L2 to fetch the lines that ``ptrs`` (a tensor of pointers, all in bounds) point into, ahead of the
    loads that will read them: a hint, no value changes. A no-op in the interpreter."""
    if _PTX:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                  pack=1)


@jit
def prefetch_rows_l2(head, rows, stride_t, stride_d, ROW_LEN: tl.constexpr):
    """Asks L2 to fetch rows ``rows`` [N] (int, all in bounds) of the [T, ROW_LEN] matrix at pointer ``head`` (row
    stride ``stride_t``, element stride ``stride_d``): one request per 128-byte line of each row, for any element
    type (ROW_LEN a power of two). A hint, like :func:`prefetch_l2`; with ``stride_d`` other than 1 it misses lines,
    never values."""
    PER_LINE: tl.constexpr = 1024 // head.dtype.element_ty.primitive_bitwidth  # elements in a 128-byte line
    LINES: tl.constexpr = (ROW_LEN + PER_LINE - 1) // PER_LINE
    prefetch_l2(head + rows[:, None] * stride_t + tl.arange(0, LINES)[None, :] * (PER_LINE * stride_d))


@jit
def exp2(x):
    """2 ** x, float32. On GPUs one ex2.approx.ftz: results below 2 ** -126 flush to 0 (softmax weights there are
    far below any 16-bit or float32 sum's resolution), where tl.exp2 and tl.exp add a subnormal fix-up of three
    instructions to every call (v9: 24 per SFA decode tile)."""
    if _PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.exp2(x)


@jit
def tanh(x):
    # Not every backend's tl has tanh. Cephes' tanhf: an odd polynomial near 0, where the exponential form would
    # cancel, and (1 - e^-2|x|) / (1 + e^-2|x|) elsewhere (never overflows). About 1 ulp of float32.
    z = x * x
    near_zero = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
                 - 3.33332819422e-1) * z * x + x
    e = tl.exp(-2.0 * tl.abs(x))
    far = (1.0 - e) / (1.0 + e)
    return tl.where(tl.abs(x) < 0.625, near_zero, tl.where(x < 0, -far, far))


@jit
def softmax_start(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax of decode kernels before any key, keys-major (:func:`softmax_step`): (acc_t [HEAD_DIM,
    BLOCK_M] = 0, l_t [BLOCK_N, BLOCK_M] = 0, m_i [BLOCK_M] = -inf), float32."""
    return (tl.zeros([HEAD_DIM, BLOCK_M], tl.float32), tl.zeros([BLOCK_N, BLOCK_M], tl.float32),
            tl.full([BLOCK_M], float("-inf"), tl.float32))


@jit
def softmax_step(acc_t, l_t, m_i, s_t, v_t, NATIVE: tl.constexpr):
    """One online-softmax step of decode kernels, keys-major, in base 2: masked logits s_t [N, M] times log2 e
    (-inf = not attended) of N keys against the program's M query rows and the keys' values transposed, v_t [D, N],
    update (acc_t [D, M], the output transposed; l_t [N, M], the softmax denominators in N partial sums per row,
    one per key slot of the tile; m_i [M], the rows' running maxima in base 2).

    Why keys-major: a decode program has few query rows (4 for 32 query heads over 8 KV heads). P @ V issued as
    V^T @ P^T makes them the MMA's N, which pads to 8, where P @ V made them its M, which pads to 16: half the
    MMAs, and half the accumulator's registers (32 rather than 64 per thread at D = 128 in one warp).

    Why partial sums: the keys of a tile lie across threads, so a row's sum over them is a chain of warp shuffles
    (5 per row in one warp) every tile; each slot's partial sum is rescaled by the same alpha as the row's total,
    so they are summed once, in :func:`softmax_finish` (v9: 40 fewer instructions per SFA tile). Why base 2: the
    kernels fold log2 e into their logit scale, and exponentials are then one instruction each (:func:`exp2`).

    P enters P @ V rounded once to V's dtype, as in FlashAttention; l_t sums it unrounded. On an H200 that kept
    both decode kernels within 1.1-1.5x the error of the reference run in bfloat16 (the tests allow 2x), against
    1.0x when P was split in two 16-bit halves for one more MMA (benchmarks/results/sfa_h200/NOTES.md, v8)."""
    m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2() away from -inf - -inf
    alpha = exp2(m_i - m_safe)
    p_t = exp2(s_t - m_safe[None, :])
    l_t = l_t * alpha[None, :] + p_t
    return acc_t * alpha[None, :] + dot(v_t, p_t.to(v_t.dtype), NATIVE), l_t, m_new


@jit
def softmax_finish(acc_t, l_t, m_i):
    """(output [M, D], log-sum-exp [M], natural log) of a keys-major online softmax in base 2 (acc_t [D, M], l_t
    [N, M]: the denominators' partial sums, m_i [M]: the maxima in base 2). A row's denominator l >= 1 where it
    attended a key (its maximum contributes 2 ** 0) and 0 otherwise, so clamping at 1 changes only the empty rows:
    output 0, log-sum-exp -inf."""
    l_i = tl.sum(l_t, axis=0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i > 0, (m_safe + tl.log2(tl.maximum(l_i, 1.0))) * _LN2, float("-inf"))
    return tl.trans(acc_t / tl.maximum(l_i, 1.0)[None, :]), lse


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def interpreter_fault(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run this package's kernels with the installed triton and numpy (or the
    versions given), or None. Triton before 3.7 turns the interpreter's scalars, one-element arrays, into loop
    bounds with ``int()``, which numpy 2.4 refuses for arrays of one dimension: every kernel whose key loop starts
    at its program's offset fails with "only 0-dimensional arrays can be converted to Python scalars"
    (triton-lang/triton#9171; fixed in 3.7)."""
    if triton_version is None:
        import numpy

        triton_version, numpy_version = triton.__version__, numpy.__version__
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run with numpy {numpy_version} (Triton < 3.7 needs "
                "numpy < 2.4, triton-lang/triton#9171): install 'numpy<2.4' or triton >= 3.7")
    return None


def kernel_blocker(q, attn_mask=None):
    """Why this package's Triton kernels cannot take ``q`` [..., D] (device, dtype, head dim) or a padding mask, or
    None when they can. Pure Python: callable without triton."""
    import torch

    if triton is None:
        return "triton is not installed"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if q.device.type != "cuda" and not interpreted:
        return f"the Triton kernels run on CUDA devices (or with TRITON_INTERPRET=1), q is on {q.device}"
    fault = interpreter_fault() if interpreted else None
    if fault:
        return fault
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernels take float16, bfloat16 or float32, q is {q.dtype}"
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"the Triton kernels take head dims that are powers of two in [16, 256], got {head_dim}"
    if attn_mask is not None:
        return "the Triton kernels take no attn_mask (padding, a sliding window); the reference does"
    return None


def choose_backend(backend: str, q, blocker) -> str:
    """"triton" or "reference" for a requested ``backend`` among auto / reference / triton (already validated):
    auto takes the kernels on CUDA when nothing blocks them; an explicit "triton" that is blocked raises
    ValueError with the reason."""
    from .._checks import fail

    if backend == "reference":
        return "reference"
    if backend == "triton":
        if blocker:
            fail("backend", "a call the Triton kernels can compute ('triton')", blocker)
        return "triton"
    return "triton" if blocker is None and q.device.type == "cuda" else "reference"
