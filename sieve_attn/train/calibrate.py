"""Calibrating SFA's feature maps from data: each layer's map becomes the principal axes of its dense q and k."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .._checks import check_int, fail
from ..integrations.transformers import head_dim, sfa_layers
from ..nn.sfa_layer import Moments


@torch.no_grad()
def calibrate_feature_maps(model, windows: torch.Tensor, *, batch_size: int = 1, progress: bool = True):
    """Sets the feature map of every SFA layer of ``model`` (composed with ``SFAConfig(feature_map=True)``) from
    the token windows [N, T]; returns the model.

    Per layer and KV head the map becomes the orthogonal matrix [D, D] whose columns are the eigenvectors, by
    decreasing eigenvalue, of C_k / tr(C_k) + C_q / tr(C_q): C_k is the mean of k k^T over the windows' keys, C_q
    the mean of q q^T over the queries of the KV head's query heads, both after RoPE. In that basis the directions
    that carry most of q's and k's energy are single coordinates, which the top-k keeps; being orthogonal, the map
    leaves every dense score q . k unchanged. The moments are those of the dense model: the windows run with every
    SFA layer at top-k = D (dense scores) and without a map, whatever maps the layers had before (a Focus pattern
    composed too stays in its current mode).

    Every process of a multi-process run must call it with the same windows (a sharded model needs each of them
    for every forward); each computes the same maps.
    """
    layers = list(sfa_layers(model))
    if not layers or any(layer.feature_map is None for layer in layers):
        fail("model", "a model composed with SFAConfig(feature_map=True)",
             "a model without SFA" if not layers else "SFA layers without a feature map")
    if windows.dim() != 2 or len(windows) == 0:
        fail("windows", "token ids [N >= 1, T]", tuple(windows.shape))
    batch_size = check_int("batch_size", batch_size, 1)
    dim = head_dim(model)
    device = next(model.parameters()).device
    saved = [(layer.topk, layer.feature_map.detach().clone()) for layer in layers]
    for layer in layers:
        layer.topk, layer.moments = dim, Moments()
        layer.feature_map.copy_(torch.eye(dim, device=layer.feature_map.device))
    try:
        for start in tqdm(range(0, len(windows), batch_size), desc="calibrate", disable=not progress, leave=False):
            model(windows[start:start + batch_size].to(device), use_cache=False)
        maps = [_principal_axes(layer.moments) for layer in layers]
    except BaseException:
        for layer, (_, old) in zip(layers, saved):
            layer.feature_map.copy_(old)
        raise
    finally:
        for layer, (topk, _) in zip(layers, saved):
            layer.topk, layer.moments = topk, None
    for layer, axes in zip(layers, maps):
        layer.feature_map.copy_(axes.to(layer.feature_map.dtype))
    return model


def _principal_axes(moments: Moments) -> torch.Tensor:
    """[Hkv, D, D]: per KV head, the eigenvectors (columns, by decreasing eigenvalue) of the trace-normalised sum
    of the mean key and query second moments."""
    joint = _unit_trace(moments.keys / moments.key_count) + _unit_trace(moments.queries / moments.query_count)
    return torch.linalg.eigh(joint.double()).eigenvectors.flip(-1).float()


def _unit_trace(moment: torch.Tensor) -> torch.Tensor:
    trace = moment.diagonal(dim1=-2, dim2=-1).sum(-1)
    return moment / trace.clamp_min(torch.finfo(moment.dtype).tiny)[:, None, None]
