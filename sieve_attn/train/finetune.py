"""Fine-tuning the weights of a model: SFA conversion of a dense model (the paper's Eq. 8), or a plain dense
fine-tune on the same data as its baseline.

Loss = LM loss + ``matching_weight`` * the mean over SFA layers of mean((O_sfa - stopgrad(O_dense))^2), where each
layer's dense output is computed from the same q, k, v (:class:`~sieve_attn.nn.sfa_layer.SFALayer`). The paper does
not report its weight (spec/sfa.md section 1), hence the sweep in docs/results.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .._checks import check_int, check_positive_float, fail
from .._files import atomic_write
from ..integrations.transformers import LAYER_ATTR, sfa_layers
from .checkpoint import load_checkpoint, save_checkpoint
from .schedule import lr_at

CHECKPOINT = "checkpoint.pt"
WEIGHTS = "model.safetensors"


@dataclass
class FinetuneSettings:
    steps: int = 100
    batch_size: int = 1
    lr: float = 5e-5
    warmup: int = 10
    seed: int = 0
    checkpoint_every: int = 25
    matching_weight: float = 1.0


def _check(windows: torch.Tensor, settings: FinetuneSettings) -> None:
    check_int("steps", settings.steps, 1)
    check_int("batch_size", settings.batch_size, 1)
    check_positive_float("lr", settings.lr)
    if not isinstance(settings.matching_weight, (int, float)) or settings.matching_weight < 0:
        fail("matching_weight", "a number >= 0", repr(settings.matching_weight))
    if windows.dim() != 2 or len(windows) == 0:
        fail("windows", "token ids [N >= 1, T]", tuple(windows.shape))


def base_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The model's own weights (not Focus routers), by name: what fine-tuning trains."""
    return {name: p for name, p in model.named_parameters() if f".{LAYER_ATTR}." not in name}


def _matching_loss(layers) -> torch.Tensor | None:
    terms = [t for layer in layers for t in layer.matching_terms]
    for layer in layers:
        layer.matching_terms.clear()
    return torch.stack(terms).mean() if terms else None


def finetune(model, windows: torch.Tensor, out_dir, settings: FinetuneSettings | None = None, *,
             resume: bool = False, progress: bool = True) -> dict:
    """Trains every weight of ``model`` (plain, or composed with an SFAConfig) on token windows [N, T].

    AdamW (no weight decay), linear warm-up then cosine decay to a tenth (as retrofit); the model runs in eval mode
    (no dropout). With SFA layers and ``matching_weight`` > 0 the output-matching term is added. Every
    ``checkpoint_every`` steps and at the end ``out_dir/checkpoint.pt`` is written atomically (weights, optimizer,
    step, history); ``resume=True`` continues from it. The weights go to ``out_dir/model.safetensors``.
    Returns {"steps", "history": [(step, lm loss, matching term or None)], "weights"}.
    """
    settings = settings or FinetuneSettings()
    _check(windows, settings)
    out_dir = Path(out_dir)
    params = base_parameters(model)
    for p in params.values():
        p.requires_grad_(True)
    layers = list(sfa_layers(model)) if settings.matching_weight > 0 else []
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(params.values(), lr=settings.lr, weight_decay=0.0)
    start, history = 0, []
    state = load_checkpoint(out_dir / CHECKPOINT) if resume else None
    if state is not None:
        model.load_state_dict(state["weights"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(settings.seed))
    model.eval()
    for layer in layers:
        layer.matching = True
    try:
        bar = tqdm(range(start, settings.steps), initial=start, total=settings.steps, desc="finetune",
                   disable=not progress)
        for step in bar:
            picks = [(step * settings.batch_size + i) % len(windows) for i in range(settings.batch_size)]
            batch = windows[order[picks]].to(device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, settings)
            lm = model(batch, labels=batch, use_cache=False).loss
            matching = _matching_loss(layers)
            loss = lm if matching is None else lm + settings.matching_weight * matching
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            history.append((step + 1, lm.item(), None if matching is None else matching.item()))
            bar.set_postfix(loss=f"{lm.item():.3f}")
            if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
                save_checkpoint({"step": step + 1, "weights": {n: p.detach() for n, p in params.items()},
                                 "optimizer": optimizer.state_dict(), "history": history,
                                 "settings": asdict(settings)}, out_dir / CHECKPOINT)
    finally:
        for layer in layers:
            layer.matching = False
            layer.matching_terms.clear()
        for p in params.values():
            p.requires_grad_(False)
    weights = out_dir / WEIGHTS
    tensors = {n: p.detach().contiguous().cpu() for n, p in params.items()}
    atomic_write(weights, lambda tmp: save_file(tensors, tmp))
    return {"steps": settings.steps, "history": history, "weights": str(weights)}


def load_weights(model, path) -> None:
    """Loads fine-tuned weights written by :func:`finetune` (``model.safetensors``) into ``model``; refuses a file
    whose tensors do not match the model's own weights in name and shape."""
    tensors = load_file(str(path))
    own = base_parameters(model)
    if set(tensors) != set(own):
        fail("weights", f"the {len(own)} weights of this model", f"{len(tensors)} tensors, "
             f"missing {sorted(set(own) - set(tensors))[:2]}, unexpected {sorted(set(tensors) - set(own))[:2]}")
    for name, tensor in tensors.items():
        if tensor.shape != own[name].shape:
            fail(f"weights tensor {name}", f"shape {tuple(own[name].shape)}", tuple(tensor.shape))
    model.load_state_dict(tensors, strict=False)
