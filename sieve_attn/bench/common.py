"""What every ``sieve bench`` command shares: options, inputs, dense SDPA baselines, the correctness gate, the timer
that skips hopeless calls, the table, the JSON record and the speedup plot.

Correctness gate: a sparse method's output is checked on sampled query rows against the row computed from the
method's definition in float32 (``exact``), and again in bf16 as plain PyTorch would (``low``). A row passes when

    max|out - exact| <= 2 * max|low - exact| + 2**-8 * max|exact|

that is, at most twice PyTorch's own bf16 error on that row (the FlashAttention rule), plus one bf16 ulp at the
row's largest value so that a row bf16 gets exactly right is not failed for a last-bit difference. The floor scales
with the row: at long lengths outputs are averages of many values and small, so an absolute floor would let a wrong
key set through. Gradients are gated the same way, each of dq, dk, dv as one tensor, against autograd of a dense
masked computation at a short length.

Skipping: any call is skipped, and recorded as null with the reason, when the last shorter length predicts more
than ``max_call_s`` per call (time grows as T**2 in prefill, T in decode), or when the method already failed or ran
out of memory at a shorter length.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._checks import check_device_option, check_kernels_can_run, skip_nan_checks
from .._files import atomic_write
from .._provenance import environment
from .timing import WARMUP_S, graphed, measure

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
DTYPE = torch.bfloat16
# Calls predicted to take longer than this get no untimed warm-up call (the first call is timed), so a dense call of
# several seconds at 1M runs once, not twice.
LONG_CALL_S = 1.0
FORWARD, BACKWARD, DECODE = "forward", "forward+backward", "decode"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Settings:
    """The settings every bench has, saved with its results; a bench's config adds its own and may change these
    defaults (the defaults are its command's)."""
    lengths: tuple[int, ...] = tuple(2 ** p for p in range(12, 21))  # 4K ... 1M
    heads: int = 8
    head_dims: tuple[int, ...] = (128,)
    backend: str = "auto"
    baselines: tuple[str, ...] = ()
    backward: bool = False
    max_backward_length: int = 256 * 1024
    decode_lengths: tuple[int, ...] = tuple(2 ** p for p in range(13, 18))  # 8K ... 128K
    decode_heads: tuple[int, int] = (32, 8)
    warmup: int = 3
    reps: int = 10
    budget_s: float = 2.0
    max_call_s: float = 20.0
    gate_rows: int = 64
    backward_gate_length: int = 4096
    skip_nan_checks: bool = False
    cuda_graphs: bool = False
    seed: int = 0
    device: str = field(default_factory=_default_device)


# ---------------------------------------------------------------------------------------------------- arguments

def parse_length(text: str) -> int:
    """'4096' -> 4096, '4K' -> 4096, '1M' -> 1048576 (K = 1024)."""
    text = text.strip().upper()
    scale = {"K": 2 ** 10, "M": 2 ** 20}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) == 0:
        raise argparse.ArgumentTypeError(f"expected a length like 4096, 4K or 1M, got {text!r}")
    return int(digits) * scale


def format_length(length: int) -> str:
    for unit, size in (("M", 2 ** 20), ("K", 2 ** 10)):
        if length % size == 0:
            return f"{length // size}{unit}"
    return str(length)


def length_list(text: str) -> tuple[int, ...]:
    """Comma list of lengths ('4K,8K,1M'); an empty string is the empty list."""
    return tuple(parse_length(part) for part in text.split(",") if part.strip())


def positive_int_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return tuple(int(part) for part in parts)


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def head_pair(text: str) -> tuple[int, int]:
    """'32/8' -> (32 query heads, 8 KV heads)."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % int(parts[1]):
        raise argparse.ArgumentTypeError(f"expected QUERY/KV heads with KV dividing QUERY, like 32/8, got {text!r}")
    return int(parts[0]), int(parts[1])


def choice_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """Argument type of a comma list of names out of ``choices``."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = sorted(set(names) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}, "
                                             f"got {', '.join(unknown)}")
        return names
    return parse


def _lengths(values) -> str:
    return ",".join(format_length(v) for v in values)


def add_int_list(group, flag: str, default: tuple[int, ...], text: str) -> None:
    """Adds the option ``flag``, a comma list of positive integers, to ``group``; its help is ``text`` and the
    default."""
    group.add_argument(flag, type=positive_int_list, default=default, help=f"{text} ({','.join(map(str, default))})")


def _add_shape_arguments(parser: argparse.ArgumentParser, d: Settings) -> None:
    """--lengths, --heads, --head-dims."""
    shape = parser.add_argument_group("shapes (B=1, bf16, causal)")
    shape.add_argument("--lengths", type=length_list, default=d.lengths,
                       help=f"sequence lengths, comma list; K = 1024, M = 1024K ({_lengths(d.lengths)})")
    shape.add_argument("--heads", type=positive_int, default=d.heads,
                       help=f"query heads = KV heads in prefill ({d.heads})")
    add_int_list(shape, "--head-dims", d.head_dims, "head dimensions D, comma list, e.g. 128,64")


def _add_mode_arguments(parser: argparse.ArgumentParser, d: Settings, baselines: tuple[str, ...],
                        baselines_help: str) -> None:
    """--baselines (a comma list out of ``baselines``), --backward, --max-backward-length, --decode-lengths and
    --decode-heads."""
    modes = parser.add_argument_group("modes and baselines")
    modes.add_argument("--baselines", type=choice_list(baselines), default=d.baselines, help=baselines_help)
    modes.add_argument("--backward", action="store_true", help="also time forward+backward")
    modes.add_argument("--max-backward-length", type=parse_length, default=d.max_backward_length,
                       help=f"longest length timed with --backward ({format_length(d.max_backward_length)})")
    modes.add_argument("--decode-lengths", type=length_list, default=d.decode_lengths,
                       help=f"KV-cache lengths for one-token decode, comma list; '' skips decode "
                            f"({_lengths(d.decode_lengths)})")
    modes.add_argument("--decode-heads", type=head_pair, default=d.decode_heads,
                       help="query/KV heads in decode (GQA), as Q/KV ({}/{})".format(*d.decode_heads))


def _add_timing_arguments(parser: argparse.ArgumentParser, d: Settings) -> None:
    """--warmup, --reps, --budget, --max-call-seconds, --gate-rows, --backward-gate-length."""
    timing = parser.add_argument_group("timing and correctness gate")
    timing.add_argument("--warmup", type=non_negative_int, default=d.warmup,
                        help=f"untimed calls before timing a call shorter than {LONG_CALL_S:g} s, and more until "
                             f"they have taken {WARMUP_S * 1000:g} ms ({d.warmup})")
    timing.add_argument("--reps", type=positive_int, default=d.reps,
                        help=f"timed calls at most, each after an L2 flush; the median is reported ({d.reps})")
    timing.add_argument("--budget", type=positive_seconds, default=d.budget_s,
                        help=f"seconds of timed calls per measurement; a longer call is timed once ({d.budget_s:g})")
    timing.add_argument("--max-call-seconds", type=positive_seconds, default=d.max_call_s,
                        help=f"skip a call predicted (from the previous length) to take longer ({d.max_call_s:g})")
    timing.add_argument("--gate-rows", type=positive_int, default=d.gate_rows,
                        help=f"sampled query rows checked against exact attention per configuration ({d.gate_rows})")
    timing.add_argument("--backward-gate-length", type=parse_length, default=d.backward_gate_length,
                        help=f"length at which gradients are checked against dense masked attention "
                             f"({format_length(d.backward_gate_length)})")
    timing.add_argument("--skip-nan-checks", action="store_true",
                        help="time the calls inside sieve_attn.skip_nan_checks(): no host synchronisation for the "
                             "NaN check of the inputs, as dense SDPA has none (outputs are still gated)")
    timing.add_argument("--cuda-graphs", action="store_true",
                        help="time forward calls and decode steps, sparse and dense alike, as replays of captured "
                             "CUDA graphs (no Python or launch overhead, as serving engines decode and static-shape "
                             "training steps run); a call that synchronises with the host cannot be captured and "
                             "its row says so; needs --skip-nan-checks")


def _add_output_arguments(parser: argparse.ArgumentParser, d: Settings, out: Path, files: str) -> None:
    """--seed, --device and --out (default ``out``, the folder of ``files``)."""
    output = parser.add_argument_group("device and output")
    output.add_argument("--seed", type=int, default=d.seed, help=f"seed of the random inputs ({d.seed})")
    output.add_argument("--device", default=d.device,
                        help="cuda or cpu (cuda when available); the CPU is for tiny smoke runs")
    output.add_argument("--out", type=Path, default=out, help=f"folder for {files} ({out})")


def add_bench_arguments(parser: argparse.ArgumentParser, d: Settings, *, method: str, add_method_arguments: Callable,
                        backends: tuple[str, ...], backend_help: str, baselines: tuple[str, ...],
                        baselines_help: str, out: Path, files: str) -> None:
    """A bench command's options, in groups, with the defaults of ``d``: shapes; the method's own, in a group titled
    ``method``, added by ``add_method_arguments(group)``, then ``--backend`` (one of ``backends``); modes and
    baselines (``--baselines`` a comma list out of ``baselines``); timing and gate; device and output (``--out``
    defaults to ``out``, the folder of ``files``)."""
    _add_shape_arguments(parser, d)
    group = parser.add_argument_group(method)
    add_method_arguments(group)
    group.add_argument("--backend", choices=backends, default=d.backend,
                       help=f"{backend_help}; each row records the one it resolved to ({d.backend})")
    _add_mode_arguments(parser, d, baselines, baselines_help)
    _add_timing_arguments(parser, d)
    _add_output_arguments(parser, d, out, files)


def refuse_above(option: str, values: tuple[int, ...], limit_option: str, limits: tuple[int, ...]) -> None:
    """Exits with a message when a value of ``option`` exceeds a value of ``limit_option`` (each must be <= every
    limit)."""
    too_large = [(value, limit) for value in values for limit in limits if value > limit]
    if too_large:
        value, limit = too_large[0]
        raise SystemExit(f"{option}: each value must be <= every {limit_option} value, got {value} with {limit}")


def settings_from_args(args: argparse.Namespace) -> dict:
    """The :class:`Settings` fields from the options that :func:`add_bench_arguments` added; exits when
    --cuda-graphs comes without --skip-nan-checks (a NaN check synchronises, which capture forbids)."""
    if args.cuda_graphs and not args.skip_nan_checks:
        raise SystemExit("--cuda-graphs: expected with --skip-nan-checks (the NaN checks synchronise with the host, "
                         "which graph capture forbids), got it alone")
    if args.cuda_graphs and not str(args.device).startswith("cuda"):
        raise SystemExit(f"--cuda-graphs: expected with a CUDA --device (graphs are CUDA's), got {args.device!r}")
    return dict(lengths=args.lengths, heads=args.heads, head_dims=args.head_dims, backend=args.backend,
                baselines=args.baselines, backward=args.backward, max_backward_length=args.max_backward_length,
                decode_lengths=args.decode_lengths, decode_heads=args.decode_heads, warmup=args.warmup,
                reps=args.reps, budget_s=args.budget, max_call_s=args.max_call_seconds, gate_rows=args.gate_rows,
                backward_gate_length=args.backward_gate_length, skip_nan_checks=args.skip_nan_checks,
                cuda_graphs=args.cuda_graphs, seed=args.seed, device=args.device)


# ---------------------------------------------------------------------------------------------------- inputs and dense

def make_qkv(q_heads: int, kv_heads: int, q_len: int, k_len: int, head_dim: int, device: torch.device,
             seed: int = 0):
    """Random bf16 q [1, Hq, Tq, D], k and v [1, Hkv, Tk, D]."""
    generator = torch.Generator(device).manual_seed(seed)

    def normal(heads, length):
        return torch.randn(1, heads, length, head_dim, generator=generator, device=device, dtype=DTYPE)
    return normal(q_heads, q_len), normal(kv_heads, k_len), normal(kv_heads, k_len)


def sdpa(q, k, v, backend: str, *, causal: bool) -> torch.Tensor:
    """Dense SDPA with one backend forced (``SDPA_BACKENDS`` key). GQA through ``enable_gqa``: K and V are read once,
    never copied per query head. ``causal`` is SDPA's top-left alignment, so decode passes False."""
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def first_working_sdpa(q, k, v, *, causal: bool) -> str:
    """The first of cudnn, flash, efficient, math that accepts these inputs (raises when none does)."""
    errors = []
    for name in SDPA_BACKENDS:
        try:
            sdpa(q, k, v, name, causal=causal)
            return name
        except RuntimeError as error:
            errors.append(f"{name}: {str(error).splitlines()[0]}")
    raise RuntimeError("no SDPA backend accepts these inputs; " + "; ".join(errors))


def forward_backward(attn: Callable, q, k, v) -> Callable[[], object]:
    """A call running attn(q, k, v) and its backward for q, k, v (fresh leaves; nothing accumulates across calls).
    The output gradient is random, drawn once at the first call (its shape is the output's)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad_out = []

    def call():
        out = attn(*leaves)
        if not grad_out:
            grad_out.append(torch.randn_like(out))
        return torch.autograd.grad(out, leaves, grad_out[0])
    return call


# ---------------------------------------------------------------------------------------------------- gate

@dataclass(frozen=True)
class Verdict:
    """Outcome of a correctness gate: ``worst_ratio`` is the largest error / tolerance (passed iff <= 1). Both are
    None when not finite (a NaN or infinite output, or a call that raised), which keeps the JSON strict."""
    passed: bool
    worst_error: Optional[float]
    worst_ratio: Optional[float]
    checked: str


def tolerance_ratio(result: torch.Tensor, exact: torch.Tensor, low_precision: torch.Tensor) -> tuple[float, float]:
    """(max error of ``result``, that error / its tolerance) against float32 ``exact``; the tolerance is twice the
    error of ``low_precision`` (plain PyTorch in bf16) plus one bf16 ulp (2**-8) of the largest exact value."""
    error = float((result.float() - exact).abs().max())
    if math.isnan(error):
        error = math.inf  # NaN would compare False against any tolerance and slip through max()
    tolerance = 2 * float((low_precision.float() - exact).abs().max()) + 2 ** -8 * float(exact.abs().max()) + 1e-12
    return error, error / tolerance


def verdict(pairs: list[tuple[float, float]], checked: str) -> Verdict:
    error, ratio = max(error for error, _ in pairs), max(ratio for _, ratio in pairs)
    finite = math.isfinite(ratio)
    return Verdict(ratio <= 1.0, error if finite else None, ratio if finite else None, checked)


def sample_rows(q_len: int, early: int, count: int, seed: int = 0) -> torch.Tensor:
    """About ``count`` distinct query rows, ascending: the first and last, an eighth spread over the first ``early``
    positions, the rest uniform at random."""
    inside = torch.linspace(0, min(early, q_len - 1), steps=max(2, count // 8)).long()
    fixed = torch.cat([inside, torch.tensor([q_len - 1])])
    rest = torch.randint(0, q_len, (max(0, count - fixed.numel()),), generator=torch.Generator().manual_seed(seed))
    return torch.cat([fixed, rest]).unique()


def attend_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax attention of one query position over exactly the given keys, computed in ``dtype``: [Hq, D].
    query [Hq, D]; keys and values [Hkv, n, D], query head h reading KV head h // (Hq // Hkv)."""
    q_heads, dim = query.shape
    grouped = query.to(dtype).view(keys.shape[0], q_heads // keys.shape[0], dim)
    scores = torch.einsum("hgd,hnd->hgn", grouped, keys.to(dtype)) * dim ** -0.5
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgn,hnd->hgd", probs, values.to(dtype)).reshape(q_heads, dim)


def check_sampled_rows(out: torch.Tensor, rows: torch.Tensor,
                       exact_row: Callable[[int, torch.dtype], torch.Tensor]) -> Verdict:
    """Gate of a forward output ``out`` [1, Hq, Tq, D] on the query rows ``rows``: ``exact_row(row, dtype)`` [Hq, D]
    is the row from the definition computed in ``dtype`` (float32: exact; DTYPE: plain PyTorch's error)."""
    pairs = [tolerance_ratio(out[0, :, row], exact_row(row, torch.float32), exact_row(row, DTYPE))
             for row in rows.tolist()]
    return verdict(pairs, f"{len(pairs)} query rows")


def dense_masked_attention(q, k, v, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention over the pairs of ``mask`` [Tq, Tk] computed in ``dtype`` by plain PyTorch (differentiable).
    q [1, Hq, Tq, D]; k, v [1, Hkv, Tk, D]."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.to(dtype).repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.to(dtype) @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values


def gradient_gate(tested: Callable, reference: Callable, q, k, v) -> Verdict:
    """Gate of a backward pass: dq, dk, dv of ``tested(q, k, v)`` against those of ``reference(q, k, v, dtype=...)``
    (differentiable, from the definition) in float32 and in DTYPE, each gradient tensor with the forward rule."""
    grad_out = torch.randn_like(q)

    def grads(attn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attn(*leaves)
        return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))

    checked = grads(tested)
    exact = grads(functools.partial(reference, dtype=torch.float32))
    low = grads(functools.partial(reference, dtype=DTYPE))
    pairs = [tolerance_ratio(t, e, lo) for t, e, lo in zip(checked, exact, low)]
    return verdict(pairs, f"dq, dk, dv at T={q.shape[2]}")


# ---------------------------------------------------------------------------------------------------- measuring

def skipped(reason: str) -> dict:
    return {"ms": None, "reps": 0, "peak_gb": None, "reason": reason}


def describe(error: Exception) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    lines = str(error).strip().splitlines()
    return f"failed: {type(error).__name__}: {lines[0][:200] if lines else ''}"


class Timer:
    """Measures calls, remembering each method's last time per key so that a call predicted to exceed
    ``max_call_s`` is skipped, and a method that failed (out of memory, unsupported) is not tried again."""

    def __init__(self, config: Settings):
        check_device_option(config.device)
        self.config = config
        self.device = torch.device(config.device)
        self.last: dict[tuple, tuple[int, float]] = {}
        self.dead: dict[tuple, str] = {}
        self.gradient_verdicts: dict[tuple, Optional[Verdict]] = {}

    def predicted_ms(self, key: tuple, length: int, power: int) -> float:
        if key not in self.last:
            return 0.0
        shorter, ms = self.last[key]
        return ms * (length / shorter) ** power

    def time(self, key: tuple, length: int, make: Callable[[], Callable], *, power: int = 2,
             gate: Optional[Callable] = None, compiled: bool = False,
             graphable: bool = False) -> tuple[dict, Optional[Verdict]]:
        """Measures the call built by ``make()`` (untimed). With ``gate``, the call's first output must pass it
        first (``gate(out) -> Verdict``); a failed gate gives no time. A ``graphable`` call (a forward or a decode
        step) on CUDA with ``cuda_graphs`` is timed as a graph replay (:func:`.timing.graphed`), captured after the
        gate. Returns
        (measurement dict, verdict or None)."""
        if key in self.dead:
            return skipped(self.dead[key]), None
        predicted = self.predicted_ms(key, length, power)
        if predicted > self.config.max_call_s * 1000:
            return skipped(f"predicted {predicted / 1000:.0f} s per call > {self.config.max_call_s:g} s"), None
        long_call = predicted > LONG_CALL_S * 1000
        checked = None
        try:
            call = make()
            warmup = 0 if long_call else self.config.warmup
            if gate is not None:
                checked = gate(call())  # the untimed first call doubles as a warm-up
                if not checked.passed:
                    return skipped("failed the correctness gate"), checked
                warmup = max(0, warmup - 1)
            if compiled:
                warmup = max(1, warmup)
            if graphable and self.config.cuda_graphs and self.device.type == "cuda":
                call = graphed(call)
            timing = measure(call, self.device, warmup=warmup, reps=self.config.reps, budget_s=self.config.budget_s)
        except Exception as error:  # noqa: BLE001 - any failure of a method is a result to record, not a crash
            self.dead[key] = f"{describe(error)} at T={length}"
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return skipped(self.dead[key]), checked
        self.last[key] = (length, timing.ms)
        return {"ms": timing.ms, "reps": timing.reps, "peak_gb": timing.peak_gb, "reason": None}, checked

    def gradient_verdict(self, key: tuple, timing_key: tuple, length: int,
                         check: Callable[[], Verdict]) -> Optional[Verdict]:
        """``check()``, the gradient gate of configuration ``key``, run once and remembered. None when it raised;
        the forward+backward timing key ``timing_key`` is then marked failed, with the reason."""
        if key not in self.gradient_verdicts:
            try:
                self.gradient_verdicts[key] = check()
            except Exception as error:  # noqa: BLE001 - recorded like any failed call
                self.gradient_verdicts[key] = None
                self.dead[timing_key] = f"{describe(error)} in the gradient check at T={length}"
        return self.gradient_verdicts[key]

    def time_backward(self, key: tuple, length: int, make: Callable[[], Callable],
                      checked: Optional[Verdict]) -> dict:
        """Measures a forward+backward call whose gradients were gated (``checked``): no time after a failed gate."""
        if checked is not None and not checked.passed:
            return skipped("failed the correctness gate")
        return self.time(key, length, make)[0]


def time_dense(timer: Timer, mode: str, q, k, v, makers: dict[str, Callable[[], Callable]],
               compiled: tuple[str, ...] = ()) -> dict:
    """Times each dense baseline ``makers[name]() -> attn(q, k, v)`` in ``mode`` (forward or forward+backward) at
    one (T, D), keyed by (name, mode, D). The makers run untimed (a FlexAttention block mask, say)."""
    length, backward = q.shape[2], mode == BACKWARD
    results = {}
    for name, maker in makers.items():
        def make(maker=maker):
            attn = maker()
            return forward_backward(attn, q, k, v) if backward else functools.partial(attn, q, k, v)
        results[name] = timer.time((name, mode, q.shape[3]), length, make, compiled=name in compiled,
                                   graphable=not backward)[0]
    return results


def decode_inputs(timer: Timer, cache_len: int, head_dim: int):
    """Random decode inputs, q [1, Hq, 1, D] (one query token) and the cache's k, v [1, Hkv, cache_len, D] with
    (Hq, Hkv) the config's ``decode_heads``, and dense SDPA's measurement over the whole cache: cuDNN when it takes
    the call, else the first of flash, efficient, math that does (``backend`` records which). Returns
    (q, k, v, measurement)."""
    c = timer.config
    q, k, v = make_qkv(*c.decode_heads, 1, cache_len, head_dim, timer.device, c.seed)
    key = ("sdpa", DECODE, head_dim)
    backend = None
    if key not in timer.dead:
        try:
            backend = first_working_sdpa(q, k, v, causal=False)
        except RuntimeError as error:
            timer.dead[key] = describe(error)
    dense, _ = timer.time(key, cache_len, lambda: functools.partial(sdpa, q, k, v, backend, causal=False), power=1,
                          graphable=True)
    dense["backend"] = backend
    return q, k, v, dense


def speedups(method: dict, baselines: dict) -> dict:
    """Each baseline's time over the method's (None where either is missing)."""
    return {name: (b["ms"] / method["ms"] if b["ms"] is not None and method["ms"] is not None else None)
            for name, b in baselines.items()}


def row_fields(mode: str, q, k, checked: Optional[Verdict]) -> dict:
    """The fields every result row starts with; ``correct`` is None when the method never got to its gate."""
    return {"mode": mode, "T": k.shape[2], "head_dim": q.shape[3], "heads": q.shape[1], "kv_heads": k.shape[1],
            "correct": None if checked is None else checked.passed,
            "gate": None if checked is None else asdict(checked)}


def sweep(timer: Timer, header: str, prefill_rows: Callable, decode_rows: Callable,
          on_rows: Optional[Callable[[list], object]] = None) -> list[dict]:
    """Every row of a bench, printed as it completes: per head dim, the prefill rows at each length (forward, and
    forward+backward up to ``max_backward_length`` with ``backward``), then the decode rows at each cache length.
    ``prefill_rows(timer, mode, q, k, v)`` and ``decode_rows(timer, cache_len, head_dim)`` return lists of rows;
    ``on_rows(rows)`` receives the rows so far after each of them (:meth:`Record.write`). With ``skip_nan_checks``
    everything runs inside :func:`sieve_attn.skip_nan_checks`."""
    config = timer.config
    print(header, flush=True)
    with skip_nan_checks() if config.skip_nan_checks else contextlib.nullcontext():
        return _sweep_rows(timer, prefill_rows, decode_rows, on_rows or (lambda rows: None))


def _sweep_rows(timer: Timer, prefill_rows: Callable, decode_rows: Callable, on_rows: Callable) -> list[dict]:
    config = timer.config
    rows = []
    for head_dim in config.head_dims:
        for length in config.lengths:
            q, k, v = make_qkv(config.heads, config.heads, length, length, head_dim, timer.device, config.seed)
            rows += prefill_rows(timer, FORWARD, q, k, v)
            on_rows(rows)
            if config.backward and length <= config.max_backward_length:
                rows += prefill_rows(timer, BACKWARD, q, k, v)
                on_rows(rows)
            del q, k, v
        for cache_len in config.decode_lengths:
            rows += decode_rows(timer, cache_len, head_dim)
            on_rows(rows)
    return rows


# ---------------------------------------------------------------------------------------------------- reporting

def table_header(columns: list[str]) -> str:
    """A markdown table's header and rule lines."""
    return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def markdown_row(cells: list) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def number(value, digits: int = 3, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


# The dense baselines a table's dense columns and a plot's solid lines show, by name and label, in order of
# preference (prefill: SDPA with cuDNN, else with FlashAttention; decode: dense SDPA).
DENSE_BASELINES = {"cudnn": "cuDNN", "flash": "FlashAttention", "sdpa": "SDPA decode"}


def dense_baseline(row: dict) -> Optional[str]:
    """The name of the dense baseline the tables and plots show for ``row``: the first of :data:`DENSE_BASELINES`
    it timed (cuDNN not asked for, or unavailable: FlashAttention), else the first it holds, None without any."""
    held = [name for name in DENSE_BASELINES if name in row["baselines"]]
    timed = [name for name in held if row["baselines"][name].get("ms") is not None]
    return (timed or held or [None])[0]


def dense_labels(rows: list[dict]) -> str:
    """The labels of the dense baselines ``rows`` show, joined with "/" ("dense" when none)."""
    names = [name for name in DENSE_BASELINES if any(dense_baseline(row) == name for row in rows)]
    return "/".join(DENSE_BASELINES[name] for name in names) or "dense"


def dense_cells(row: dict) -> list[str]:
    """The 'cuDNN ms' and 'x cuDNN' cells of a row: its :func:`dense_baseline`, the SDPA backend that ran named
    when it is not cuDNN (FlashAttention asked for alone; decode rows' dense SDPA)."""
    name = dense_baseline(row)
    dense = row["baselines"][name] if name else skipped("not requested")
    dense_ms = number(dense["ms"])
    backend = dense.get("backend", name)
    if backend not in (None, "cudnn"):
        dense_ms += f" ({backend})"
    return [dense_ms, number(row["speedup"].get(name), 2, "x")]


def gate_cell(correct: Optional[bool]) -> str:
    return {True: "ok", False: "FAIL", None: "-"}[correct]


def plot_modes(rows: list[dict], path: Path, draw: Callable) -> Path:
    """PNG with one panel per mode present in ``rows`` (forward, forward+backward, decode), drawn by
    ``draw(ax, rows of that mode, mode)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in (FORWARD, BACKWARD, DECODE) if any(r["mode"] == m for r in rows)] or [FORWARD]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        draw(ax, [r for r in rows if r["mode"] == mode], mode)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))  # the temporary file keeps the name: PNG
    plt.close(fig)
    return path


def plot_ratio(ax, rows: list[dict], ratio: Callable[[dict], Optional[float]], **style) -> None:
    """One line of ``ratio(row)`` against the rows' T, over the rows where it is measured (not None)."""
    points = sorted((r["T"], ratio(r)) for r in rows if ratio(r) is not None)
    if points:
        ax.plot(*zip(*points), **style)


def speedup_axis(ax, rows: list[dict], mode: str, ylabel: str, title: str) -> None:
    """Log-log speedup axes over the rows' lengths, a line at 1x, labels, and the legend (or a note that nothing
    was measured)."""
    import matplotlib.ticker

    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    # Speedups span 0.01x (a reference backend) to 10x and more: only a log scale shows both.
    ax.set_yscale("log")
    # 1-2-5 ticks: a run's speedups often span less than a decade, which plain decade ticks would leave unlabelled.
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    lengths = sorted({r["T"] for r in rows})
    ax.set_xticks(lengths, [format_length(t) for t in lengths])
    ax.minorticks_off()
    ax.set_xlabel("cached tokens" if mode == DECODE else "sequence length T")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speedup measured", transform=ax.transAxes, ha="center")


class Record:
    """OUT/json_name of a bench run: environment, settings, ``extra``, the rows, and whether the sweep is
    "complete". Built before any timing (it checks --device and --out), rewritten atomically as rows complete, so
    an error or a kill mid-sweep keeps the rows measured."""

    def __init__(self, config: Settings, out: Path, json_name: str, **extra):
        check_device_option(config.device)
        check_kernels_can_run("--backend", config.backend, config.device)
        for extra_backend in getattr(config, "extra_backends", ()):  # `bench focus --backends`
            check_kernels_can_run("--backends", extra_backend, config.device)
        out = Path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SystemExit(f"--out: expected a folder this run can write, got {str(out)!r} "
                             f"({error.strerror or error})") from None
        if not os.access(out, os.W_OK):
            raise SystemExit(f"--out: expected a folder this run can write, got {str(out)!r} (not writable)")
        self.out, self.path = out, out / json_name
        self.base = {"environment": environment(torch.device(config.device)), "settings": asdict(config), **extra}

    def write(self, rows: list[dict], complete: bool = False) -> Path:
        record = {**self.base, "complete": complete, "rows": rows}
        atomic_write(self.path, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=2)))
        return self.path


def finish(record: Record, rows: list[dict], plot: Callable[[list, Path], Path], png_name: str, *,
           method: str) -> int:
    """Writes the complete ``record`` and the plot OUT/png_name; returns the exit status: 1 if any row failed its
    gate or the method under test (``row[method]``) raised (what :func:`describe` calls failed; out of memory and
    calls skipped as too long are results, not failures), else 0. Each such row is printed with its reason."""
    json_path = record.write(rows, complete=True)
    plot_path = plot(rows, record.out / png_name)
    failed = [row for row in rows if row["correct"] is False or (row[method].get("reason") or "").startswith("failed")]
    for row in failed:
        print(f"FAILED {row['mode']} T={format_length(row['T'])} D={row['head_dim']}: "
              f"{row[method]['reason'] or 'the correctness gate'}")
    print(f"wrote {json_path} and {plot_path}" + (f"; {len(failed)} configuration(s) FAILED" if failed else ""))
    return 1 if failed else 0
