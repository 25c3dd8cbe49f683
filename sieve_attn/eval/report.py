"""Perplexity of a model densely, under Focus and under SFA, as a table and a JSON record."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .._checks import fail
from .._files import atomic_write
from ..integrations.transformers import focus_layers, has_focus, is_composed, set_focus_mode
from .perplexity import perplexity

MODES = ("dense", "soft", "hard")
# Every mode a row can have: "sfa" is SFA alone (with Focus too, Focus switched to attending every causal pair),
# and with SFA composed, soft and hard score through it.
ALL_MODES = (*MODES, "sfa")


def each_mode(model, modes=MODES):
    """Yields each of ``modes`` in order, with ``model`` switched to it while the caller scores it. On a plain model
    only "dense" applies (the model's own attention); on a model composed with SFA alone only "sfa" (its SFA
    attention); on a model composed with Focus each of dense, soft and hard is switched to in turn (soft and hard
    route causally); on one composed with Focus and SFA each of sfa (Focus switched to "dense": SFA scores over
    every causal pair), soft and hard (SFA scores inside the Focus pattern). Every mode is checked before the first
    is yielded (ValueError naming ``modes``); the model is left in the Focus mode it had."""
    composed = has_focus(model)
    with_sfa = getattr(model, "sieve_sfa_config", None) is not None
    if composed and with_sfa:
        allowed, kind = ("sfa", "soft", "hard"), "a model composed with Focus and SFA"
    elif composed:
        allowed, kind = MODES, "a model composed with Focus"
    elif is_composed(model):
        allowed, kind = ("sfa",), "a model composed with SFA alone"
    else:
        allowed, kind = ("dense",), "a plain model"
    for mode in modes:
        if mode not in allowed:
            fail("modes", f"one of {', '.join(allowed)} for {kind}", mode)
    previous = model.sieve_config.mode if composed else None
    try:
        for mode in modes:
            if composed:
                set_focus_mode(model, "dense" if mode == "sfa" else mode)
            yield mode
    finally:
        if composed:
            set_focus_mode(model, previous)


def evaluate_modes(model, windows: torch.Tensor, modes=MODES, *, batch_size: int = 1,
                   progress: bool = True) -> list[dict]:
    """One PPL row per mode, in order, each scored in that mode (:func:`each_mode`)."""
    return [{"mode": mode, **perplexity(model, windows, batch_size=batch_size, desc=mode, progress=progress)}
            for mode in each_mode(model, modes)]


def router_parameter_count(model) -> int:
    return sum(p.numel() for layer in focus_layers(model) for p in layer.router.parameters())


def format_table(rows: list[dict]) -> str:
    lines = ["| mode | PPL | tokens | pairs attended |", "|---|---|---|---|"]
    for row in rows:
        pairs = "100%" if row["mode"] == "dense" else (
            "-" if row["pairs_attended"] is None else f"{100 * row['pairs_attended']:.1f}%")
        lines.append(f"| {row['mode']} | {row['ppl']:.3f} | {row['tokens']} | {pairs} |")
    return "\n".join(lines)


def write_json(record: dict, path) -> Path:
    """Writes ``record`` as indented JSON to ``path`` atomically (:func:`sieve_attn._files.atomic_write`)."""
    path = Path(path)
    text = json.dumps(record, indent=2)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path
