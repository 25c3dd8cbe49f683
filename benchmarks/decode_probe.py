"""Side-by-side timing of SFA decode variants on one GPU (a device probe for tuning, not a test, not the bench).

A variant is ``MODULE[:NAME=VALUE;...]``: the ``sfa_decode_triton`` of ``sieve_attn.ops.sfa.MODULE`` (``decode``,
the library's, or a copy of an earlier version placed beside it) with module-level knobs set first (``_POOLED``,
``_PREFETCH_TILES``, ...; a knob of ``split_k`` is named ``split_k.NAME``). Each variant is gated like the tests
(error against float64 at most twice the error of the reference run in the low precision, plus 1e-6, over 3
calls, since the pool's split varies; a FAIL prints no time) and captured as a CUDA graph with its knobs; then all
are timed (cold L2, :func:`sieve_attn.bench.timing.measure`) once per round in ``--rounds`` interleaved rounds beside
dense SDPA-cuDNN decode over the same dense cache, and the median of the rounds is reported. Rounds interleave
because one build's time moves from process to process by more than the differences probed.

GQA 32/8 by default, batch 1, one query. Example (the step against an earlier copy, and two prefetch depths):
    python benchmarks/decode_probe.py --out OUT --variants decode,_decode_v11,decode:_PREFETCH_TILES=4
Writes OUT/decode_probe.json (every gate and timing row, the device and torch version).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path

import torch

from sieve_attn import skip_nan_checks
from sieve_attn.bench.common import head_pair, length_list, positive_int_list, sdpa
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops import split_k
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.reference import sfa_attention_reference


def parse_variant(text: str) -> tuple:
    """``MODULE[:NAME=VALUE;...]`` -> (module, [(owner, name, value)]), values as int, else float."""
    name, _, knobs = text.partition(":")
    module = importlib.import_module(f"sieve_attn.ops.sfa.{name}")
    settings = []
    for knob in filter(None, knobs.split(";")):
        key, _, value = knob.partition("=")
        owner, _, attr = key.rpartition(".")
        target = split_k if owner == "split_k" else module
        if not hasattr(target, attr):
            raise SystemExit(f"--variants: {text!r} names {key!r}, which {target.__name__} does not have")
        settings.append((target, attr, int(value) if value.lstrip("-").isdigit() else float(value)))
    return module, settings


def apply(settings) -> dict:
    """Sets the knobs; returns what they were, to set back."""
    before = {}
    for target, attr, value in settings:
        before[(target, attr)] = getattr(target, attr)
        setattr(target, attr, value)
    return before


def restore(before: dict) -> None:
    for (target, attr), value in before.items():
        setattr(target, attr, value)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def gate_and_capture(variant: str, q, cache, exact, low_error: float, scale: float):
    """(row, graph replay or None) of one variant: its gate, and its step captured with its knobs set."""
    module, settings = parse_variant(variant)
    before = apply(settings)
    row = dict(variant=variant)
    try:
        with skip_nan_checks():
            run = lambda: module.sfa_decode_triton(q, cache, scale=scale)[0]  # noqa: E731
            errors = [max_error(run(), exact) for _ in range(3)]
            row.update(err_ratio=max(errors) / low_error, ok=max(errors) <= 2 * low_error + 1e-6)
            replay = graphed(run) if row["ok"] else None
    except Exception as error:  # noqa: BLE001 - a variant that fails is a row, not the end of the probe
        row["error"] = repr(error)[:300]
        replay = None
    finally:
        restore(before)
    return row, replay


def interleaved(replays: dict, device: torch.device, rounds: int) -> dict:
    """{name: [ms per round]}: every replay timed once per round, the rounds one after another."""
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            times[name].append(measure(replay, device, warmup=20, reps=50, budget_s=1.0).ms)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for decode_probe.json")
    parser.add_argument("--variants", required=True, help="comma-separated MODULE[:NAME=VALUE;...] (';' between knobs)")
    parser.add_argument("--lengths", type=length_list, default=(131072,), help="cached tokens, e.g. 64K,128K")
    parser.add_argument("--topk", type=positive_int_list, default=(16, 8))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=head_pair, default=(32, 8), help="query and KV heads, e.g. 32/8")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    variants = args.variants.split(",")
    device, (q_heads, kv_heads), head_dim = torch.device("cuda"), args.heads, args.head_dim
    scale = head_dim ** -0.5
    rows = []
    for length in args.lengths:
        torch.manual_seed(0)
        q = torch.randn(1, q_heads, 1, head_dim, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, length, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
        replays = {"dense": graphed(lambda: sdpa(q, k, v, "cudnn", causal=False))}
        for topk in args.topk:
            cache = SFAKeyCache(1, kv_heads, head_dim, topk=topk, dtype=torch.bfloat16, device=device,
                                capacity=length)
            cache.append(k, v)
            exact = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True,
                                            scale=scale)[0]
            low_error = max_error(sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)[0], exact)
            timed = {"dense": replays["dense"]}
            for variant in variants:
                row, replay = gate_and_capture(variant, q, cache, exact, low_error, scale)
                rows.append(dict(row, T=length, topk=topk))
                print(("" if row.get("ok") else "FAIL ") + json.dumps(rows[-1]), flush=True)
                if replay is not None:
                    timed[variant] = replay
            times = interleaved(timed, device, args.rounds)
            dense_ms = statistics.median(times["dense"])
            for name, samples in times.items():
                ms = statistics.median(samples)
                rows.append(dict(variant=name, T=length, topk=topk, D=head_dim, rounds=samples, ms=ms,
                                 x_dense=dense_ms / ms))
                print(json.dumps(rows[-1]), flush=True)
            del cache
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_probe.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, variants=variants, rows=rows), indent=1))


if __name__ == "__main__":
    main()
