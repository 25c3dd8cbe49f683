"""Calibrating SFA's feature maps and selection weights from data: each layer's map becomes the principal axes of
its dense q and k, and its importance weights the root mean squares of its keys and queries in that basis."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .._checks import check_int, fail
from ..integrations.transformers import head_dim, sfa_layers
from ..nn.sfa_layer import Moments


@torch.no_grad()
def calibrate_feature_maps(model, windows: torch.Tensor, *, batch_size: int = 1, progress: bool = True):
    """Sets the feature map and the selection weights of every SFA layer of ``model`` (composed with
    ``SFAConfig(feature_map=True)``, ``selection="importance"``, or both) from the token windows [N, T]; returns
    the model.

    Per layer and KV head the map becomes the orthogonal matrix M [D, D] whose columns are the eigenvectors, by
    decreasing eigenvalue, of C_k / tr(C_k) + C_q / tr(C_q): C_k is the mean of k k^T over the windows' keys, C_q
    the mean of q q^T over the queries of the KV head's query heads, both after RoPE. In that basis the directions
    that carry most of q's and k's energy are single coordinates, which the top-k keeps; being orthogonal, the map
    leaves every dense score q . k unchanged. The importance weights of the queries become the keys' root mean
    square along each coordinate of that basis, sqrt(diag(M^T C_k M)), and those of the keys the queries', sqrt(diag(
    M^T C_q M)) (M the identity for a layer without a map): the expected size of a coordinate's term q_u k_u given
    the vector's own value. The moments are those of the dense model: the windows run with every SFA layer at
    top-k = D (dense scores) and without a map, whatever maps the layers had before (a Focus pattern composed too
    stays in its current mode).

    Every process of a multi-process run must call it with the same windows (a sharded model needs each of them
    for every forward); each computes the same maps.
    """
    layers = list(sfa_layers(model))
    if not layers or all(layer.feature_map is None and layer.selection_weights is None for layer in layers):
        fail("model", "a model composed with SFAConfig(feature_map=True) or SFAConfig(selection='importance')",
             "a model without SFA" if not layers else "SFA layers with neither a feature map nor selection weights")
    if not isinstance(windows, torch.Tensor):
        fail("windows", "a tensor of token ids [N >= 1, T]", type(windows).__name__)
    if windows.dim() != 2 or len(windows) == 0 or windows.dtype not in (torch.int32, torch.int64):
        fail("windows", "token ids [N >= 1, T] of dtype int64 or int32", f"{tuple(windows.shape)} {windows.dtype}")
    batch_size = check_int("batch_size", batch_size, 1)
    dim = head_dim(model)
    device = next(model.parameters()).device
    saved = [(layer.topk, None if layer.feature_map is None else layer.feature_map.detach().clone())
             for layer in layers]
    for layer in layers:
        layer.topk, layer.moments = dim, Moments()
        if layer.feature_map is not None:
            layer.feature_map.copy_(torch.eye(dim, device=layer.feature_map.device))
    try:
        for start in tqdm(range(0, len(windows), batch_size), desc="calibrate", disable=not progress, leave=False):
            model(windows[start:start + batch_size].to(device), use_cache=False)
        calibrated = [_calibrated(layer) for layer in layers]
    except BaseException:
        for layer, (_, old) in zip(layers, saved):
            if old is not None:
                layer.feature_map.copy_(old)
        raise
    finally:
        for layer, (topk, _) in zip(layers, saved):
            layer.topk, layer.moments = topk, None
    for layer, (axes, weights) in zip(layers, calibrated):
        if layer.feature_map is not None:
            layer.feature_map.copy_(axes.to(layer.feature_map.dtype))
        if layer.selection_weights is not None:
            layer.selection_weights.copy_(weights)
    return model


def _calibrated(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(map [Hkv, D, D], selection weights [2, Hkv, D]) from the layer's dense moments: the principal axes when
    the layer has a map (else the identity), and the root mean squares of the keys (for ranking queries) and of the
    queries (for ranking keys) along each of its coordinates."""
    moments = layer.moments
    keys, queries = moments.keys / moments.key_count, moments.queries / moments.query_count
    if layer.feature_map is None:
        axes = torch.eye(keys.shape[-1], device=keys.device).expand_as(keys)
    else:
        joint = _unit_trace(keys) + _unit_trace(queries)
        axes = torch.linalg.eigh(joint.double()).eigenvectors.flip(-1).float()
    spread = [torch.einsum("hdu,hde,heu->hu", axes, moment, axes).clamp_min(0).sqrt() for moment in (keys, queries)]
    return axes, torch.stack(spread)


def _unit_trace(moment: torch.Tensor) -> torch.Tensor:
    trace = moment.diagonal(dim1=-2, dim2=-1).sum(-1)
    return moment / trace.clamp_min(torch.finfo(moment.dtype).tiny)[:, None, None]
