"""The learning-rate schedule every training loop of the package uses."""
from __future__ import annotations

import math


def lr_at(step: int, settings) -> float:
    """Learning rate of 0-based ``step``: linear warm-up over ``settings.warmup`` steps to ``settings.lr``, then
    cosine decay to a tenth of it at ``settings.steps``."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))
