"""Perplexity of a causal LM on token windows, with the fraction of attention pairs a Focus model attends."""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..integrations.transformers import focus_layers, is_composed


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, *, batch_size: int = 1, desc: str = "ppl", progress: bool = True) -> dict:
    """Mean next-token NLL over every predicted token of windows [N, T] (each window evaluated from its start).

    Returns {"ppl", "nll", "tokens", "pairs_attended"}; pairs_attended is the fraction of causal pairs the hard
    Focus pattern attends (None unless the model is composed and in hard mode).
    """
    layers = list(focus_layers(model)) if is_composed(model) else []
    for layer in layers:
        layer.count_pairs, layer.pair_counts = True, [0, 0]
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    try:
        for start in tqdm(range(0, len(windows), batch_size), desc=desc, disable=not progress, leave=False):
            batch = windows[start:start + batch_size].to(device)
            logits = model(batch, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                    reduction="sum")
            total_nll += float(nll)
            total_tokens += batch[:, 1:].numel()
    finally:
        counts = [sum(layer.pair_counts[i] for layer in layers) for i in (0, 1)]
        for layer in layers:
            layer.count_pairs = False
    nll = total_nll / total_tokens
    return {"ppl": math.exp(nll), "nll": nll, "tokens": total_tokens,
            "pairs_attended": counts[0] / counts[1] if counts[1] else None}
