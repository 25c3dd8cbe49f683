"""Sparse codes of SFA: each vector keeps only its ``topk`` coordinates of largest magnitude.

Selection rule, shared by every SFA path: for a vector x [D], coordinate u is kept iff fewer than ``topk``
coordinates v rank above it, where v ranks above u when |x_v| > |x_u|, or |x_v| == |x_u| and v < u. So among equal
magnitudes the lower coordinate index wins. ``torch.topk`` leaves ties unspecified (on the CPU it does not pick
the lowest index), which would make bf16/fp16 codes, where equal magnitudes are common, differ between devices and
from a future kernel; a stable sort pins the rule. x should hold no NaN (its rank is unspecified).

Weighted selection (:func:`sparsify` with ``weights``): coordinate u ranks by |x_u| * w_u instead, with the same
tie rule; the kept values are still x's own. A calibrated layer uses it to prefer the coordinates that carry more of
the scores (:class:`~sieve_attn.nn.sfa_layer.SFALayer`).

Two forms: (indices, values) pairs (:func:`sparse_codes`, the compact form of a key cache, which also bit-packs
the indices: :func:`.cache.pack_indices`) and the zero-filled dense vector (:func:`sparsify`, what the reference
attention multiplies). :func:`densify` turns the first into the second.
"""
from __future__ import annotations

import torch

from ..._checks import check_int, fail, fail_where, nan_checks_skipped


def index_dtype(dim: int) -> torch.dtype:
    """Smallest integer dtype holding every coordinate index 0 .. dim - 1: uint8 up to dim = 256, int16 up to
    32768, else int32."""
    if dim <= 256:
        return torch.uint8
    if dim <= 2 ** 15:
        return torch.int16
    return torch.int32


def _check_x(x) -> int:
    """x: float tensor [..., D] with D >= 1. Returns D."""
    if not isinstance(x, torch.Tensor):
        fail("x", "a torch.Tensor [..., D]", type(x).__name__)
    if not x.dtype.is_floating_point:
        fail("x", "a floating-point tensor", x.dtype)
    if x.dim() == 0 or x.shape[-1] == 0:
        fail("x", "a tensor [..., D] with D >= 1", f"shape {tuple(x.shape)}")
    return x.shape[-1]


def _check_weights(weights, x: torch.Tensor) -> None:
    """Selection weights: a float tensor on x's device, broadcastable to x, finite and >= 0 (the values are read on
    the device: one host synchronisation, none within :func:`sieve_attn.skip_nan_checks`)."""
    if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
        fail("weights", "a float tensor", type(weights).__name__ if not isinstance(weights, torch.Tensor)
             else weights.dtype)
    if weights.device != x.device:
        fail("weights", f"a tensor on x's device ({x.device})", weights.device)
    try:
        fits = torch.broadcast_shapes(weights.shape, x.shape) == x.shape
    except RuntimeError:
        fits = False
    if not fits:
        fail("weights", f"a tensor broadcastable to x's shape {tuple(x.shape)}", f"shape {tuple(weights.shape)}")
    if not nan_checks_skipped():
        fail_where([("weights", "finite values >= 0", "a negative, infinite or NaN value",
                     ~(torch.isfinite(weights) & (weights >= 0)).all())])


def top_indices(x: torch.Tensor, topk: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [..., topk]: the kept coordinates of x [..., D], by decreasing |x| (times ``weights``, broadcast to
    x, when given), ties by increasing index.

    No argument checks (callers have done them). The selection is not differentiable and needs no graph.
    """
    rank = x.detach().abs() if weights is None else x.detach().abs() * weights
    order = torch.sort(rank, dim=-1, descending=True, stable=True).indices
    return order[..., :topk]


def sparse_codes(x: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``topk`` coordinates by |x| of every vector of x [..., D] (rule in the module docstring).

    Returns:
        indices [..., topk] in :func:`index_dtype` (D) (uint8 for D <= 256): coordinates by decreasing |x|, ties by
            increasing index. PyTorch's gather, scatter and index_select accept only int32/int64 indices, so
            convert with ``indices.long()`` before indexing (:func:`densify` does).
        values [..., topk] in x's dtype: x at those coordinates, signed. Differentiable: the gradient reaches x at
            the selected coordinates only.
    """
    dim = _check_x(x)
    topk = check_int("topk", topk, 1, dim)
    indices = top_indices(x, topk)
    return indices.to(index_dtype(dim)), x.gather(-1, indices)


def densify(indices: torch.Tensor, values: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-filled dense [..., dim] tensor with ``values`` [..., k] at ``indices`` [..., k] and 0 elsewhere; dtype
    of values. Differentiable in values. ``indices``: an integer tensor on values' device, coordinates in [0, dim)
    distinct within each vector (ValueError otherwise; the values are checked with the NaN checks, so not within
    :func:`sieve_attn.skip_nan_checks`)."""
    dim = check_int("dim", dim, 1)
    if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point:
        fail("values", "a float tensor [..., k]", getattr(values, "dtype", type(values).__name__))
    if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dtype.is_complex or \
            indices.dtype == torch.bool:
        fail("indices", "an integer tensor [..., k]", getattr(indices, "dtype", type(indices).__name__))
    if values.dim() == 0:
        fail("values", "a float tensor [..., k]", "a 0-d tensor")
    if indices.shape != values.shape:
        fail("indices", f"the shape of values {tuple(values.shape)}", f"shape {tuple(indices.shape)}")
    if indices.device != values.device:
        fail("indices", f"a tensor on values' device ({values.device})", indices.device)
    if not nan_checks_skipped():
        fail_where(index_checks(indices, dim))
    return scatter_codes(indices, values, dim)


def index_checks(indices: torch.Tensor, dim: int) -> list:
    """The :func:`~sieve_attn._checks.fail_where` checks that ``indices`` [..., k] hold coordinates in [0, dim),
    distinct within each vector: with a repeated one, a scatter or a kernel's select would each keep one of its
    values, not necessarily the same one."""
    wide = indices.long()
    ordered = wide.sort(dim=-1).values
    return [("indices", f"coordinates in [0, {dim})", "one outside", ((wide < 0) | (wide >= dim)).any()),
            ("indices", "distinct coordinates within each vector", "a repeated coordinate",
             (ordered[..., 1:] == ordered[..., :-1]).any())]


def scatter_codes(indices: torch.Tensor, values: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`densify` without its checks, for codes this package made (a cache's, a selection's)."""
    dense = values.new_zeros(*values.shape[:-1], dim)
    return dense.scatter(-1, indices.long(), values)


def sparsify(x: torch.Tensor, topk: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] with all but its top-``topk`` coordinates by |x| set to 0 (same shape and dtype).

    ``weights``: optional float tensor on x's device, broadcastable to x, finite and >= 0 (ValueError otherwise);
    coordinates then rank by |x| * weights (module docstring). The result has at most ``topk`` nonzeros, so
    sparsifying it again with the plain rule returns it unchanged: weighted codes pass through every SFA path as
    they are.

    Gradients follow the paper's straight-through rule (Eq. 6): the selection is a constant, so the gradient of x
    is the incoming gradient on the selected coordinates and exactly 0 on the others, i.e. autograd of
    ``x * mask`` with ``mask`` fixed.
    """
    topk = check_int("topk", topk, 1, _check_x(x))
    if weights is not None:
        _check_weights(weights, x)
    return select(x, topk, weights)


def select(x: torch.Tensor, topk: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sparsify` without its argument checks, for callers that have done them (an SFA layer ranking by its
    own calibrated weights, which would otherwise wait on the device for every check of them)."""
    indices = top_indices(x, topk, weights)
    return scatter_codes(indices, x.gather(-1, indices), x.shape[-1])
