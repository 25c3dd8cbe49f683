"""Router-only training of a composed model: the pretrained weights stay frozen, only Focus routers learn."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .._checks import check_int, check_positive_float, fail
from ..integrations.transformers import adapter_state, focus_layers, is_composed, save_adapter, set_focus_mode
from .checkpoint import load_checkpoint, save_checkpoint

CHECKPOINT = "checkpoint.pt"


@dataclass
class RetrofitSettings:
    steps: int = 200
    batch_size: int = 1
    lr: float = 1e-2
    warmup: int = 10
    seed: int = 0
    checkpoint_every: int = 25


def _lr_at(step: int, settings: RetrofitSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def retrofit(model, windows: torch.Tensor, out_dir, settings: RetrofitSettings | None = None, *,
             resume: bool = False, progress: bool = True) -> dict:
    """Trains the Focus routers of a composed ``model`` on token windows [N, T] with the LM loss.

    AdamW over the router parameters only; the base model runs in eval mode (no dropout) with its weights frozen.
    Every ``checkpoint_every`` steps and at the end, ``out_dir/checkpoint.pt`` is written atomically (routers,
    optimizer, step, loss history); ``resume=True`` continues from it. The trained adapter goes to
    ``out_dir/adapter``. Returns {"steps", "history" (list of (step, loss)), "adapter"}.
    """
    settings = settings or RetrofitSettings()
    check_int("steps", settings.steps, 1)
    check_int("batch_size", settings.batch_size, 1)
    check_positive_float("lr", settings.lr)
    if not is_composed(model):
        fail("model", "a model composed with sieve_attn.compose", "a plain model")
    if windows.dim() != 2 or len(windows) == 0:
        fail("windows", "token ids [N >= 1, T]", tuple(windows.shape))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    router_names = set(adapter_state(model))
    if not trainable or not set(trainable) <= router_names:
        fail("model", "trainable parameters that are all Focus router parameters",
             sorted(set(trainable) - router_names)[:3] or "none trainable")
    out_dir = Path(out_dir)
    device = next(model.parameters()).device
    inference_mode = model.sieve_config.mode
    optimizer = torch.optim.AdamW(trainable.values(), lr=settings.lr, weight_decay=0.0)
    start, history = 0, []
    state = load_checkpoint(out_dir / CHECKPOINT) if resume else None
    if state is not None:
        model.load_state_dict(state["routers"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(settings.seed))

    def checkpoint(step):
        save_checkpoint({"step": step, "routers": adapter_state(model), "optimizer": optimizer.state_dict(),
                         "history": history, "settings": asdict(settings)},
                        out_dir / CHECKPOINT)

    model.eval()
    set_focus_mode(model, "train")
    for layer in focus_layers(model):
        layer.router.train()
    try:
        bar = tqdm(range(start, settings.steps), initial=start, total=settings.steps, desc="retrofit",
                   disable=not progress)
        for step in bar:
            picks = [(step * settings.batch_size + i) % len(windows) for i in range(settings.batch_size)]
            batch = windows[order[picks]].to(device)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, settings)
            loss = model(batch, labels=batch, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            history.append((step + 1, loss.item()))
            bar.set_postfix(loss=f"{history[-1][1]:.3f}")
            if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
                checkpoint(step + 1)
    finally:
        for layer in focus_layers(model):
            layer.router.eval()
        set_focus_mode(model, inference_mode)
    adapter = save_adapter(model, out_dir / "adapter")
    return {"steps": settings.steps, "history": history, "adapter": str(adapter)}
