"""Side-by-side timing of decode variants (SFA's or Focus's) on one GPU (a device probe for tuning, not a test, not
the bench).

A variant is ``MODULE[:NAME=VALUE;...]``: the decode step of ``sieve_attn.ops.KERNEL.MODULE`` (``decode``, the
library's, or a copy of an earlier version placed beside it; ``sfa_decode_triton`` for ``--kernel sfa``,
``focus_decode`` with window 128 for ``--kernel focus``) with module-level knobs set first (``_POOLED``,
``_PREFETCH_TILES``, ``_PREFETCH_KEYS``, ...; a knob of ``split_k`` is named ``split_k.NAME``). SFA runs each
``--topk`` over its compressed key cache; Focus each ``--topk`` (memberships per token) over ``--groups`` random
groups of balanced sizes (the bench's "combinations" spread). Each variant is gated like the tests (error against
float64 at most twice the error of the reference run in the low precision, plus 1e-6, over 3 calls, since SFA's
pool split varies; a FAIL prints no time) and captured as a CUDA graph with its knobs; then all
are timed (cold L2, :func:`sieve_attn.bench.timing.measure`) once per round in ``--rounds`` interleaved rounds beside
dense SDPA-cuDNN decode over the same dense cache, and the median of the rounds is reported. Rounds interleave
because one build's time moves from process to process by more than the differences probed.

GQA 32/8 and batch 1 by default, one query. Examples (the step against an earlier copy, and two prefetch depths):
    python benchmarks/decode_probe.py --out OUT --variants decode,_decode_v11,decode:_PREFETCH_TILES=4
    python benchmarks/decode_probe.py --kernel focus --topk 1,2 --out OUT --variants decode:_PREFETCH_KEYS=0,decode
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
from sieve_attn.bench.focus import balanced_groups
from sieve_attn.bench.timing import graphed, measure
from sieve_attn.ops import split_k
from sieve_attn.ops.focus.reference import focus_attention_reference, group_bits
from sieve_attn.ops.sfa.cache import SFAKeyCache
from sieve_attn.ops.sfa.reference import sfa_attention_reference

FOCUS_WINDOW = 128


def parse_variant(kernel: str, text: str) -> tuple:
    """``MODULE[:NAME=VALUE;...]`` -> (module of sieve_attn.ops.KERNEL, [(owner, name, value)]), values as int,
    else float."""
    name, _, knobs = text.partition(":")
    module = importlib.import_module(f"sieve_attn.ops.{kernel}.{name}")
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


def sfa_cases(q, k, v, topks, scale: float):
    """(top-k, step(module) -> out, float64 reference, low-precision reference's error) per SFA top-k."""
    for topk in topks:
        cache = SFAKeyCache(k.shape[0], k.shape[1], k.shape[3], topk=topk, dtype=k.dtype, device=k.device,
                            capacity=k.shape[2])
        cache.append(k, v)
        exact = sfa_attention_reference(q.double(), k.double(), v.double(), topk=topk, causal=True, scale=scale)[0]
        low_error = max_error(sfa_attention_reference(q, k, v, topk=topk, causal=True, scale=scale)[0], exact)
        yield topk, lambda module: module.sfa_decode_triton(q, cache, scale=scale)[0], exact, low_error


def focus_cases(q, k, v, top_ks, num_groups: int, scale: float):
    """As :func:`sfa_cases`, per Focus top-k over ``num_groups`` balanced random groups (each sequence of the
    batch its own draw)."""
    for top_k in top_ks:
        groups = torch.cat([balanced_groups(k.shape[2], num_groups, top_k, seed=seq) for seq in range(k.shape[0])])
        groups = groups.to(k.device)
        bits = group_bits(groups)
        reference = lambda *x: focus_attention_reference(  # noqa: E731
            *x, groups, window=FOCUS_WINDOW, causal=True, scale=scale)[0]
        exact = reference(q.double(), k.double(), v.double())
        low_error = max_error(reference(q, k, v), exact)
        yield top_k, lambda module: module.focus_decode(q, k, v, bits, window=FOCUS_WINDOW, scale=scale)[0], \
            exact, low_error


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that choose the decode steps (kernel, top-k, groups, head dim, heads, batch): this probe's and
    decode_timeline.py's."""
    parser.add_argument("--kernel", choices=("sfa", "focus"), default="sfa")
    parser.add_argument("--topk", type=positive_int_list, default=(16, 8),
                        help="SFA's top-k, or Focus's memberships per token (default: 16,8)")
    parser.add_argument("--groups", type=int, default=8, help="Focus's group count K (default: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=head_pair, default=(32, 8), help="query and KV heads, e.g. 32/8")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded at once, each with its own cache")


def step_inputs(args, length: int, device: torch.device):
    """Seeded bf16 decode inputs of ``args``' batch, heads and head dim: q [B, Hq, 1, D], k and v [B, Hkv, length,
    D]."""
    (q_heads, kv_heads), head_dim, batch = args.heads, args.head_dim, args.batch
    torch.manual_seed(0)
    q = torch.randn(batch, q_heads, 1, head_dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def dense_step(q, k, v):
    """Dense SDPA-cuDNN decode over the whole cache, captured as a CUDA graph."""
    return graphed(lambda: sdpa(q, k, v, "cudnn", causal=False))


def step_cases(args, q, k, v):
    """:func:`sfa_cases` or :func:`focus_cases` of ``args``, at scale D ** -0.5."""
    scale = args.head_dim ** -0.5
    if args.kernel == "sfa":
        return sfa_cases(q, k, v, args.topk, scale)
    return focus_cases(q, k, v, args.topk, args.groups, scale)


def gate_and_capture(kernel: str, variant: str, step, exact, low_error: float):
    """(row, graph replay or None) of one variant: its gate, and its step captured with its knobs set."""
    module, settings = parse_variant(kernel, variant)
    before = apply(settings)
    row = dict(variant=variant)
    try:
        with skip_nan_checks():
            run = lambda: step(module)  # noqa: E731
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
    add_step_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    variants = args.variants.split(",")
    device, head_dim = torch.device("cuda"), args.head_dim
    rows = []
    for length in args.lengths:
        q, k, v = step_inputs(args, length, device)
        dense = dense_step(q, k, v)
        for topk, step, exact, low_error in step_cases(args, q, k, v):
            timed = {"dense": dense}
            for variant in variants:
                row, replay = gate_and_capture(args.kernel, variant, step, exact, low_error)
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_probe.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, kernel=args.kernel,
        groups=args.groups if args.kernel == "focus" else None, heads=list(args.heads), batch=args.batch,
        variants=variants, rows=rows), indent=1))


if __name__ == "__main__":
    main()
