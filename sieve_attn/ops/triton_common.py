"""Triton building blocks shared by the attention kernels (Focus prefill and decode, SFA decode).

triton is optional (the "dev" extra; CUDA builds of torch bring it): without it this module still imports, ``jit``
returns the plain function and no kernel is ever launched.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


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
def softmax_start(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax of decode kernels before any key, keys-major (:func:`softmax_step`): (acc_t [HEAD_DIM,
    BLOCK_M] = 0, l_i [BLOCK_M] = 0, m_i [BLOCK_M] = -inf), float32."""
    return (tl.zeros([HEAD_DIM, BLOCK_M], tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.full([BLOCK_M], float("-inf"), tl.float32))


@jit
def softmax_step(acc_t, l_i, m_i, s_t, v_t, NATIVE: tl.constexpr):
    """One online-softmax step of decode kernels, keys-major: masked logits s_t [N, M] (natural units, -inf = not
    attended) of N keys against the program's M query rows and the keys' values transposed, v_t [D, N], update
    (acc_t [D, M], the output transposed; l_i [M]; m_i [M]).

    Why keys-major: a decode program has few query rows (4 for 32 query heads over 8 KV heads). P @ V issued as
    V^T @ P^T makes them the MMA's N, which pads to 8, where P @ V made them its M, which pads to 16: half the
    MMAs, and half the accumulator's registers (32 rather than 64 per thread at D = 128 in one warp).

    P enters P @ V rounded once to V's dtype, as in FlashAttention; l_i sums it unrounded. On an H200 that kept
    both decode kernels within 1.1-1.5x the error of the reference run in bfloat16 (the tests allow 2x), against
    1.0x when P was split in two 16-bit halves for one more MMA (benchmarks/results/sfa_h200/NOTES.md, v8)."""
    m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp() away from -inf - -inf
    alpha = tl.exp(m_i - m_safe)
    p_t = tl.exp(s_t - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p_t, axis=0)
    return acc_t * alpha[None, :] + dot(v_t, p_t.to(v_t.dtype), NATIVE), l_i, m_new


@jit
def softmax_finish(acc_t, l_i, m_i):
    """(output [M, D], log-sum-exp [M]) of a keys-major online softmax (acc_t [D, M]). l_i >= 1 for a row with an
    attended key (its maximum contributes exp(0)) and 0 otherwise, so clamping at 1 changes only the empty rows:
    output 0, log-sum-exp -inf."""
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i > 0, m_safe + tl.log(tl.maximum(l_i, 1.0)), float("-inf"))
    return tl.trans(acc_t / tl.maximum(l_i, 1.0)[None, :]), lse


def kernel_blocker(q, attn_mask=None):
    """Why this package's Triton kernels cannot take ``q`` [..., D] (device, dtype, head dim) or a padding mask, or
    None when they can. Pure Python: callable without triton."""
    import os

    import torch

    if triton is None:
        return "triton is not installed"
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels run on CUDA devices (or with TRITON_INTERPRET=1), q is on {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernels take float16, bfloat16 or float32, q is {q.dtype}"
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"the Triton kernels take head dims that are powers of two in [16, 256], got {head_dim}"
    if attn_mask is not None:
        return "the Triton kernels take no attn_mask (padding); the reference does"
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
