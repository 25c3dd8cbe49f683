"""Argument checks shared by every public entry point.

Each check raises ``ValueError`` whose message names the argument, what was expected and what came, so a user
can fix the call without reading our source.
"""
from __future__ import annotations

import contextlib
import math
import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """SDPA layout: q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D] with Hq % Hkv == 0, one float dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(name, "a torch.Tensor", type(t).__name__)
        if t.dim() != 4:
            fail(name, "a 4-d tensor [B, H, T, D]", f"shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            fail(name, "a float16, bfloat16, float32 or float64 tensor", t.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail("k, v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        fail("k, v", f"the device of q ({q.device})", f"k {k.device}, v {v.device}")
    if k.shape != v.shape:
        fail("v", f"the shape of k {tuple(k.shape)}", f"shape {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        fail("k", f"batch size {q.shape[0]} (that of q)", k.shape[0])
    if k.shape[3] != q.shape[3]:
        fail("k", f"head dim {q.shape[3]} (that of q)", k.shape[3])
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        fail("k", f"a number of KV heads dividing the {q.shape[1]} query heads", k.shape[1])
    if q.shape[2] > k.shape[2]:
        fail("q", f"at most as many query tokens as keys ({k.shape[2]})", q.shape[2])
    if q.shape[2] == 0:
        fail("q", "at least one query token", 0)
    if q.shape[3] == 0:
        fail("q", "a head dim D >= 1", 0)


def fail_where(checks: list) -> None:
    """ValueError for the first of ``checks`` that holds, each (name, expected, got, bad) with ``bad`` a 0-dim bool
    tensor computed on the data's device: one host synchronisation for all of them, however many."""
    if not checks:
        return
    flags = torch.stack([bad for *_, bad in checks]).tolist()
    for (name, expected, got, _), bad in zip(checks, flags):
        if bad:
            fail(name, expected, got)


def check_tensors_fit(what: str, tensors: dict, own: dict, description: str) -> None:
    """ValueError unless ``tensors`` (name -> tensor, e.g. loaded from a file) has exactly the names of ``own`` (the
    model's) and each one's shape; ``description`` says what ``own`` holds, e.g. "router tensors of this model"."""
    if set(tensors) != set(own):
        fail(what, f"the {len(own)} {description}", f"{len(tensors)} tensors, missing "
             f"{sorted(set(own) - set(tensors))[:3]}, unexpected {sorted(set(tensors) - set(own))[:3]}")
    for name, tensor in tensors.items():
        if tensor.shape != own[name].shape:
            fail(f"{what} tensor {name}", f"shape {tuple(own[name].shape)}", tuple(tensor.shape))


_nan_checks_skipped = False


@contextlib.contextmanager
def skip_nan_checks():
    """Within ``with sieve_attn.skip_nan_checks():`` no op checks its inputs for NaN.

    Checking values means reading them on the device and waiting for the answer on the host: one synchronisation
    per call, which a decoding loop pays at every step and CUDA-graph capture forbids. Inside the block a NaN input
    gives NaN outputs instead of a ValueError. Every other check stays: layouts, dtypes, devices, and the values
    that would make a kernel read out of bounds (group ids, memberships). Nests; not thread-local.
    """
    global _nan_checks_skipped
    previous, _nan_checks_skipped = _nan_checks_skipped, True
    try:
        yield
    finally:
        _nan_checks_skipped = previous


def nan_checks_skipped() -> bool:
    """Whether the caller is inside :func:`skip_nan_checks` (value checks that read the device are off)."""
    return _nan_checks_skipped


def nan_checks(**tensors: torch.Tensor) -> list:
    """The :func:`fail_where` checks that each named tensor holds no NaN and no infinity (either would reach every
    later output as NaN); none within :func:`skip_nan_checks`."""
    if nan_checks_skipped():
        return []
    return [(name, "no NaN values and no infinities", "a NaN or an infinity", ~torch.isfinite(t).all())
            for name, t in tensors.items()]


def check_no_nan(**tensors: torch.Tensor) -> None:
    """ValueError naming the first tensor holding a NaN or an infinity; one host synchronisation for all of them
    (none within :func:`skip_nan_checks`)."""
    fail_where(nan_checks(**tensors))


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as a Python int, where it is an integer in [low, high] (high None: no bound): an int or any other
    integral number (numpy's), never a bool."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low and \
        (high is None or value <= high)
    if not ok:
        fail(name, f"an int in [{low}, {'inf' if high is None else high}]", repr(value))
    return int(value)


def check_real(name: str, value, within, expected: str) -> float:
    """``value`` as a Python float, where it is a real number (numpy's too, never a bool) for which ``within``
    (value) holds (NaN fails any comparison); else ValueError saying ``expected``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not within(value):
        fail(name, expected, repr(value))
    return float(value)


def check_positive_float(name: str, value) -> float:
    return check_real(name, value, lambda x: 0 < x < math.inf, "a finite positive number")


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        fail(name, f"one of {sorted(choices)}", repr(value))
    return value


def resolve_scale(scale, head_dim: int) -> float:
    """``scale`` defaults to 1/sqrt(D)."""
    if scale is None:
        return head_dim ** -0.5
    return check_positive_float("scale", scale)


def check_softcap(softcap) -> float | None:
    return None if softcap is None else check_positive_float("softcap", softcap)


def _one_or(size: int) -> str:
    """A dimension that broadcasts: "1" or "1 or size"."""
    return "1" if size == 1 else f"1 or {size}"


def check_attn_mask(attn_mask, q: torch.Tensor, k: torch.Tensor):
    if attn_mask is None:
        return None
    b, hq, tq, tk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    ok = (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool and attn_mask.dim() == 4
          and attn_mask.shape[0] in (1, b) and attn_mask.shape[1] in (1, hq) and tuple(attn_mask.shape[2:]) == (tq, tk))
    if not ok:
        got = f"{attn_mask.dtype} shape {tuple(attn_mask.shape)}" if isinstance(attn_mask, torch.Tensor) else attn_mask
        fail("attn_mask", f"a bool tensor [{_one_or(b)}, {_one_or(hq)}, {tq}, {tk}]", got)
    if attn_mask.device != q.device:
        fail("attn_mask", f"a tensor on q's device ({q.device})", attn_mask.device)
    return attn_mask


def check_bool(name: str, value) -> bool:
    """``value`` as a bool when it is one (Python's, numpy's or a 0-d bool tensor); anything else is refused rather
    than read by its truth ("no" would be True, None False)."""
    is_bool = isinstance(value, bool) or type(value).__name__ in ("bool", "bool_") or (  # numpy 2, numpy 1
        isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0)
    if not is_bool:
        fail(name, "True or False", repr(value))
    return bool(value)


def check_out(out, q: torch.Tensor) -> None:
    if out is None:
        return
    ok = (isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
          and out.is_contiguous())
    if not ok:
        got = (f"{'' if out.is_contiguous() else 'a non-contiguous '}{out.dtype} {tuple(out.shape)} on {out.device}"
               if isinstance(out, torch.Tensor) else out)
        fail("out", f"a contiguous {q.dtype} tensor {tuple(q.shape)} on {q.device}", got)


def check_attention_call(q, k, v, *, attn_mask=None, out=None, value_checks: tuple = ()):
    """The checks every attention op shares: q/k/v layout, no NaN, the optional padding mask and output buffer.
    Returns attn_mask. ``value_checks``: the op's own :func:`fail_where` checks on other inputs' values, made in the
    same host synchronisation as the NaN checks (one per call: a training step calls an op per layer).

    With a KV cache (Tq < Tk) only the keys and values of the new tokens (the last Tq) are checked for NaN: the
    cached ones were checked by the calls that added them, and re-reading the whole cache would cost a decode step
    as many bytes as dense attention does."""
    check_qkv(q, k, v)
    new = k.shape[2] - q.shape[2]
    fail_where(nan_checks(q=q, k=k[:, :, new:], v=v[:, :, new:]) + list(value_checks))
    check_out(out, q)
    return check_attn_mask(attn_mask, q, k)


def check_device_option(name: str) -> None:
    """Exits unless ``name`` (--device) is the CPU or a CUDA device torch sees here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cuda" and not (
            torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count())):
        raise SystemExit(f"--device: expected cpu or a CUDA device torch sees ({torch.cuda.device_count()} here), "
                         f"got {name!r}")


def check_kernels_can_run(option: str, backend, device: str, got: str = "'triton'") -> None:
    """Exits (naming --device or ``option``) when ``option`` asks for the Triton kernels ("triton") on a device
    where they cannot run: the CPU without TRITON_INTERPRET=1, or no triton installed. ``got`` says where the
    backend came from in the message."""
    from .ops.triton_common import kernel_blocker

    if backend != "triton":
        return
    check_device_option(device)
    blocker = kernel_blocker(torch.empty(0, 16, device=device))
    if blocker:
        raise SystemExit(f"{option}: expected a backend that runs on --device {device}, got {got} ({blocker})")
