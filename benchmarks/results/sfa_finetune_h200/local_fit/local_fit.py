# Session 35 experiment: `sieve finetune --method sfa` started from feature maps fitted layer by layer to the dense
# outputs, instead of the principal axes alone. Runs the `sieve finetune` command line with one change: right after
# calibrate_feature_maps (PCA maps and importance weights, as always), each SFA layer's map is trained for FIT_STEPS
# Adam steps (lr FIT_LR) to minimise mean((O_sfa - O_dense)^2) / mean(O_dense^2) over the calibration windows, where
# both outputs take the layer's dense-model inputs (q, k after RoPE and v, recorded with every layer dense); the
# importance weights are recomputed from the dense moments in the map's basis every 20 steps and at the end (the
# rule of calibrate_feature_maps). Everything else is the command's own. A probe, not a library mode:
#   FIT_STEPS=200 FIT_LR=2e-3 python local_fit.py finetune --method sfa ... (the sieve command's arguments)
import os
import sys
import time

import torch
import torch.nn.functional as F

import sieve_attn.cli
import sieve_attn.train.calibrate as calibrate
from sieve_attn.integrations.transformers import sfa_layers
from sieve_attn.nn.sfa_layer import SFALayer
from sieve_attn.ops.sfa.codes import select

STEPS, LR, BATCH = int(os.environ.get("FIT_STEPS", 200)), float(os.environ.get("FIT_LR", 2e-3)), 2
library_calibration = calibrate.calibrate_feature_maps


def record_dense_inputs(model, windows, layers):
    """{layer: (q, k, v)} of every calibration window (float32, on the model's device), every layer dense."""
    dim = layers[0].feature_map.shape[-1]
    saved = [(layer.topk, layer.feature_map.detach().clone(), layer.selection_weights.clone()) for layer in layers]
    inputs = {id(layer): [] for layer in layers}
    attend = SFALayer.attend

    def recording(self, q, k, v, **kw):
        inputs[id(self)].append((q.detach().float(), k.detach().float(), v.detach().float()))
        return attend(self, q, k, v, **kw)

    for layer in layers:
        layer.topk = dim
        layer.feature_map.data.copy_(torch.eye(dim, device=layer.feature_map.device))
        layer.selection_weights.fill_(1)
    SFALayer.attend = recording
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            for window in windows:
                model(window[None].to(device), use_cache=False)
    finally:
        SFALayer.attend = attend
        for layer, (topk, fmap, weights) in zip(layers, saved):
            layer.topk = topk
            layer.feature_map.data.copy_(fmap)
            layer.selection_weights.copy_(weights)
    return {key: tuple(torch.cat(t) for t in zip(*value)) for key, value in inputs.items()}


def importance(fmap, keys_moment, queries_moment):
    """[2, Hkv, D]: the keys' and the queries' root mean square along each coordinate of the map's basis."""
    return torch.stack([torch.einsum("hdu,hde,heu->hu", fmap, m, fmap).clamp_min(0).sqrt()
                        for m in (keys_moment, queries_moment)])


def sparse_output(layer, fmap, weights, q, k, v, scale):
    hkv = k.shape[1]
    qm = torch.matmul(q.unflatten(1, (hkv, -1)), fmap[:, None])
    qs = select(qm, layer.topk, weights[0, :, None, None, :]).flatten(1, 2)
    ks = select(torch.matmul(k, fmap), layer.topk, weights[1, :, None, :])
    return F.scaled_dot_product_attention(qs, ks, v, is_causal=True, scale=scale, enable_gqa=True)


def fit_layer(layer, q, k, v):
    scale = q.shape[-1] ** -0.5
    hkv = k.shape[1]
    keys_moment = torch.einsum("bhtd,bhte->hde", k, k) / (k.shape[0] * k.shape[2])
    qg = q.unflatten(1, (hkv, -1))
    queries_moment = torch.einsum("bhgtd,bhgte->hde", qg, qg) / (qg.shape[0] * qg.shape[2] * qg.shape[3])
    with torch.no_grad():
        target = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        norm = target.pow(2).mean()
    fmap = layer.feature_map.detach().float().clone().requires_grad_(True)
    weights = layer.selection_weights.float()
    optimizer = torch.optim.Adam([fmap], lr=LR)
    error = lambda o, t: ((o - t).pow(2).mean() / norm)
    with torch.no_grad():
        before = error(sparse_output(layer, fmap, weights, q, k, v, scale), target).item()
    for step in range(STEPS):
        batch = torch.randperm(len(q), device=q.device)[:BATCH]
        loss = error(sparse_output(layer, fmap, weights, q[batch], k[batch], v[batch], scale), target[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 20 == 0:
            weights = importance(fmap.detach(), keys_moment, queries_moment)
    weights = importance(fmap.detach(), keys_moment, queries_moment)
    with torch.no_grad():
        after = error(sparse_output(layer, fmap, weights, q, k, v, scale), target).item()
        layer.feature_map.data.copy_(fmap.detach())
        layer.selection_weights.copy_(weights)
    return before, after


def calibrate_and_fit(model, windows, **kwargs):
    library_calibration(model, windows, **kwargs)
    if STEPS == 0:
        return model
    started = time.time()
    layers = list(sfa_layers(model))
    inputs = record_dense_inputs(model, windows, layers)
    errors = []
    for layer in layers:
        errors.append(fit_layer(layer, *inputs.pop(id(layer))))
    print(f"local fit: {STEPS} steps, lr {LR}, {len(windows)} windows, {time.time() - started:.0f} s; relative output "
          f"error mean {sum(e[0] for e in errors) / len(errors):.4f} -> {sum(e[1] for e in errors) / len(errors):.4f}; "
          "per layer " + " ".join(f"{a:.3f}>{b:.3f}" for a, b in errors), flush=True)
    return model


calibrate.calibrate_feature_maps = calibrate_and_fit
sys.exit(sieve_attn.cli.main(sys.argv[1:]))
