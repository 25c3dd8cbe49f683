"""``sieve bench focus``: Focus attention against dense attention kernels, every configuration checked first.

Inputs are random bf16 q, k, v (B=1) and random balanced groups. Each Focus configuration passes a correctness gate
in the same run before its time is reported; a configuration that fails prints FAIL and reports no speed.

Baselines, on the same inputs:
- ``cudnn``, ``flash``: dense causal SDPA with that backend forced;
- ``flex``: compiled FlexAttention with a causal block mask (built once, untimed, like a cuDNN plan);
- ``prototype``: the same-group part alone as a first prototype would compute it (tokens sorted by group, groups
  padded to the longest, one batched causal SDPA-cuDNN call, unpacked; no window, no merge). Focus must beat it;
- ``sdpa`` (decode only): dense SDPA over the whole cache, cuDNN when it takes one query token, else the first of
  flash, efficient, math that does (the row records which).

Correctness gate (forward and decode): about ``gate_rows`` query rows are sampled (the first and last positions,
some inside the first window, the rest at random). For each, the exact output is computed from q, k, v and groups
directly: the row's attended keys are gathered (keys j <= i within the window or sharing a group with i) and
attention over them is done in float32, and again in bf16 as plain PyTorch would. A row passes when

    max|focus - fp32| <= 2 * max|bf16 - fp32| + 2**-8 * max|fp32|

that is, at most twice PyTorch's own bf16 error on that row (the FlashAttention rule), plus one bf16 ulp at the
row's largest value so that a row bf16 gets exactly right is not failed for a last-bit difference. The floor scales
with the row: at long lengths outputs are averages of many values and small, so an absolute floor would let a wrong
key set through. Backward is gated once per (D, K, top-k) at a short length (``backward_gate_length``): dq, dk, dv
of the Focus call against a dense masked attention built from the definition, with the same rule per gradient.

Any call (dense, prototype or Focus) is skipped, and recorded as null with the reason, when the last shorter length
predicts more than ``max_call_s`` per call (time grows as T**2 in prefill, T in decode), or when the method already
failed or ran out of memory at a shorter length.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..ops.focus import attention as focus_ops
from ..ops.focus.groups import FocusGroups
from .timing import measure

BASELINES = ("cudnn", "flash", "flex", "prototype")
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
class BenchConfig:
    """Everything one run measures, saved with the results; the defaults are the command's."""
    lengths: tuple[int, ...] = tuple(2 ** p for p in range(12, 21))  # 4K ... 1M
    heads: int = 8
    head_dims: tuple[int, ...] = (128,)
    group_counts: tuple[int, ...] = (4, 8, 16)
    top_ks: tuple[int, ...] = (1, 2)
    window: int = 128
    backend: str = "auto"
    baselines: tuple[str, ...] = BASELINES
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


def length_list(text: str) -> tuple[int, ...]:
    """Comma list of lengths ('4K,8K,1M'); an empty string is the empty list."""
    return tuple(parse_length(part) for part in text.split(",") if part.strip())


def positive_int_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return tuple(int(part) for part in parts)


def head_pair(text: str) -> tuple[int, int]:
    """'32/8' -> (32 query heads, 8 KV heads)."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % int(parts[1]):
        raise argparse.ArgumentTypeError(f"expected QUERY/KV heads with KV dividing QUERY, like 32/8, got {text!r}")
    return int(parts[0]), int(parts[1])


def baseline_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(names) - set(BASELINES))
    if unknown:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(BASELINES)}, got {', '.join(unknown)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``sieve bench focus``."""
    d = BenchConfig()

    def lengths(values) -> str:
        return ",".join(format_length(v) for v in values)

    def ints(values) -> str:
        return ",".join(map(str, values))

    shape = parser.add_argument_group("shapes (B=1, bf16, causal)")
    shape.add_argument("--lengths", type=length_list, default=d.lengths,
                       help=f"sequence lengths, comma list; K = 1024, M = 1024K ({lengths(d.lengths)})")
    shape.add_argument("--heads", type=int, default=d.heads, help=f"query heads = KV heads in prefill ({d.heads})")
    shape.add_argument("--head-dims", type=positive_int_list, default=d.head_dims,
                       help=f"head dimensions D, comma list, e.g. 128,64 ({ints(d.head_dims)})")
    focus = parser.add_argument_group("Focus pattern")
    focus.add_argument("--groups", type=positive_int_list, default=d.group_counts,
                       help=f"group counts K, comma list; random groups of balanced sizes ({ints(d.group_counts)})")
    focus.add_argument("--top-k", type=positive_int_list, default=d.top_ks,
                       help=f"groups per token, comma list; each must be <= every K ({ints(d.top_ks)})")
    focus.add_argument("--window", type=int, default=d.window, help=f"local window w: 0 <= i-j <= w ({d.window})")
    focus.add_argument("--backend", choices=focus_ops.BACKENDS, default=d.backend,
                       help=f"focus_attention backend under test; each row records the one it resolved to "
                            f"({d.backend})")
    modes = parser.add_argument_group("modes and baselines")
    modes.add_argument("--baselines", type=baseline_list, default=d.baselines,
                       help="comma list of cudnn, flash (dense causal SDPA), flex (compiled FlexAttention), "
                            "prototype (sorted, padded same-group SDPA-cuDNN without the window) (all)")
    modes.add_argument("--backward", action="store_true", help="also time forward+backward")
    modes.add_argument("--max-backward-length", type=parse_length, default=d.max_backward_length,
                       help=f"longest length timed with --backward ({format_length(d.max_backward_length)})")
    modes.add_argument("--decode-lengths", type=length_list, default=d.decode_lengths,
                       help=f"KV-cache lengths for one-token decode, comma list; '' skips decode "
                            f"({lengths(d.decode_lengths)})")
    modes.add_argument("--decode-heads", type=head_pair, default=d.decode_heads,
                       help="query/KV heads in decode (GQA), as Q/KV ({}/{})".format(*d.decode_heads))
    timing = parser.add_argument_group("timing and correctness gate")
    timing.add_argument("--warmup", type=int, default=d.warmup,
                        help=f"untimed calls before timing a call shorter than {LONG_CALL_S:g} s ({d.warmup})")
    timing.add_argument("--reps", type=int, default=d.reps,
                        help=f"timed calls at most, each after an L2 flush; the median is reported ({d.reps})")
    timing.add_argument("--budget", type=float, default=d.budget_s,
                        help=f"seconds of timed calls per measurement; a longer call is timed once ({d.budget_s:g})")
    timing.add_argument("--max-call-seconds", type=float, default=d.max_call_s,
                        help=f"skip a call predicted (from the previous length) to take longer ({d.max_call_s:g})")
    timing.add_argument("--gate-rows", type=int, default=d.gate_rows,
                        help=f"sampled query rows checked against exact attention per configuration ({d.gate_rows})")
    timing.add_argument("--backward-gate-length", type=parse_length, default=d.backward_gate_length,
                        help=f"length at which gradients are checked against dense masked attention "
                             f"({format_length(d.backward_gate_length)})")
    output = parser.add_argument_group("device and output")
    output.add_argument("--seed", type=int, default=d.seed, help=f"seed of inputs and groups ({d.seed})")
    output.add_argument("--device", default=d.device,
                        help="cuda or cpu (cuda when available); the CPU is for tiny smoke runs")
    output.add_argument("--out", type=Path, default=Path("runs") / "bench_focus",
                        help="folder for bench_focus.json and speedup_vs_length.png (runs/bench_focus)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    too_large = [(k, g) for k in args.top_k for g in args.groups if k > g]
    if too_large:
        raise SystemExit(f"--top-k: each top-k must be <= every --groups value, got top-k {too_large[0][0]} "
                         f"with K={too_large[0][1]}")
    return BenchConfig(lengths=args.lengths, heads=args.heads, head_dims=args.head_dims, group_counts=args.groups,
                       top_ks=args.top_k, window=args.window, backend=args.backend, baselines=args.baselines,
                       backward=args.backward, max_backward_length=args.max_backward_length,
                       decode_lengths=args.decode_lengths, decode_heads=args.decode_heads, warmup=args.warmup,
                       reps=args.reps, budget_s=args.budget, max_call_s=args.max_call_seconds,
                       gate_rows=args.gate_rows, backward_gate_length=args.backward_gate_length, seed=args.seed,
                       device=args.device)


# ---------------------------------------------------------------------------------------------------- inputs

def balanced_groups(length: int, num_groups: int, top_k: int, *, seed: int = 0) -> torch.Tensor:
    """Random groups of balanced sizes: int64 [1, length, top_k] on the CPU.

    A random permutation of the tokens is dealt round-robin into the K groups (slot 0); slot s holds
    (slot-0 group + s) % K, so a token's slots are distinct and every slot is balanced to within one token.
    """
    if not 1 <= top_k <= num_groups:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_groups={num_groups}, got {top_k}")
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(seed))
    first = torch.empty(length, dtype=torch.long)
    first[perm] = torch.arange(length) % num_groups
    return ((first[:, None] + torch.arange(top_k)) % num_groups)[None]


def make_qkv(q_heads: int, kv_heads: int, q_len: int, k_len: int, head_dim: int, device: torch.device,
             seed: int = 0):
    """Random bf16 q [1, Hq, Tq, D], k and v [1, Hkv, Tk, D]."""
    generator = torch.Generator(device).manual_seed(seed)

    def normal(heads, length):
        return torch.randn(1, heads, length, head_dim, generator=generator, device=device, dtype=DTYPE)
    return normal(q_heads, q_len), normal(kv_heads, k_len), normal(kv_heads, k_len)


# ---------------------------------------------------------------------------------------------------- baselines

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


def _causal(batch, head, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Every (T, D) is a new static shape; past the default 8 recompilations dynamo would fall back to eager flex
    # attention, which materialises the T x T scores.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def flex_causal(length: int, device: torch.device) -> Callable:
    """Compiled FlexAttention with a causal block mask for T = ``length``; returns attn(q, k, v). The mask is built
    here (compiled, so no T x T tensor exists), outside what is timed."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(_causal, None, None, length, length, device=device, _compile=True)
    compiled = _compiled_flex()
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def prototype_same_group(q, k, v, groups: torch.Tensor, num_groups: int, backend: str = "cudnn") -> torch.Tensor:
    """Same-group attention alone, computed as a first prototype would: one copy of each token per group it is in,
    stable-sorted by group (tokens stay in order within a group), each group padded to the longest, one batched
    causal SDPA call over [K, H, L, D], unpacked. No window part and no merge of a token's copies.

    q, k, v: [1, H, T, D] (MHA); groups: int [1, T, m] with every slot filled. Returns [T, m, H, D]: the output of
    each token's copy in each of its m groups. Padding sits after the real tokens, so causality keeps it unseen.
    """
    _, heads, length, dim = q.shape
    members = groups.shape[2]
    ids = groups.reshape(-1)  # entry e is token e // m
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=num_groups)
    longest = int(counts.max())
    sorted_ids = ids[order]
    rank = torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    slot = sorted_ids * longest + rank  # place in the padded [K * L] layout
    token = order // members

    def pack(x):  # [1, H, T, D] -> [K, H, L, D]
        rows = x[0].transpose(0, 1)[token]
        # Zeros, not empty: a padded V row meets probability 0, and 0 * NaN would poison the block.
        padded = x.new_zeros(num_groups * longest, heads, dim).index_copy(0, slot, rows)
        return padded.view(num_groups, longest, heads, dim).transpose(1, 2)

    out = sdpa(pack(q), pack(k), pack(v), backend, causal=True)
    rows = out.transpose(1, 2).reshape(num_groups * longest, heads, dim)[slot]
    return rows.new_empty(rows.shape).index_copy(0, order, rows).view(length, members, heads, dim)


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


def sample_rows(q_len: int, window: int, count: int, seed: int = 0) -> torch.Tensor:
    """About ``count`` distinct query rows, ascending: the first and last, an eighth spread over the first window,
    the rest uniform at random."""
    inside = torch.linspace(0, min(window, q_len - 1), steps=max(2, count // 8)).long()
    fixed = torch.cat([inside, torch.tensor([q_len - 1])])
    rest = torch.randint(0, q_len, (max(0, count - fixed.numel()),), generator=torch.Generator().manual_seed(seed))
    return torch.cat([fixed, rest]).unique()


def attended_keys(groups: torch.Tensor, position: int, window: int) -> torch.Tensor:
    """Indices of the keys j <= ``position`` that the query at ``position`` attends. groups: int [1, Tk, m]."""
    keys = groups[0, : position + 1]
    mine = groups[0, position]
    shared = ((keys[:, :, None] == mine[None, None, :]) & (mine >= 0)).any(dim=-1).any(dim=-1)
    local = torch.arange(position + 1, device=groups.device) >= position - window
    return torch.nonzero(shared | local).squeeze(1)


def exact_row(q, k, v, groups, row: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Attention of query row ``row`` over exactly its attended keys, computed in ``dtype``: [Hq, D].

    q [1, Hq, Tq, D], k and v [1, Hkv, Tk, D]; query row i sits at key position Tk - Tq + i."""
    q_heads, q_len, dim = q.shape[1], q.shape[2], q.shape[3]
    kv_heads, k_len = k.shape[1], k.shape[2]
    keys = attended_keys(groups, k_len - q_len + row, window)
    query = q[0, :, row].to(dtype).view(kv_heads, q_heads // kv_heads, dim)
    scores = torch.einsum("hgd,hnd->hgn", query, k[0][:, keys].to(dtype)) * dim ** -0.5
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hgn,hnd->hgd", probs, v[0][:, keys].to(dtype)).reshape(q_heads, dim)


def check_rows(out: torch.Tensor, q, k, v, groups, rows: torch.Tensor, window: int) -> Verdict:
    """Gate of a forward output ``out`` [1, Hq, Tq, D] on the query rows ``rows`` (see the module docstring)."""
    pairs = []
    for row in rows.tolist():
        exact = exact_row(q, k, v, groups, row, window, torch.float32)
        low = exact_row(q, k, v, groups, row, window, DTYPE)
        pairs.append(tolerance_ratio(out[0, :, row], exact, low))
    return verdict(pairs, f"{len(pairs)} query rows")


def focus_mask(groups: torch.Tensor, window: int) -> torch.Tensor:
    """The causal Focus pattern as a dense bool [T, T] (short T only). groups: int [1, T, m]."""
    slots = groups[0]
    pos = torch.arange(slots.shape[0], device=groups.device)
    distance = pos[:, None] - pos[None, :]
    allowed = distance <= window
    for a in range(slots.shape[1]):
        for b in range(slots.shape[1]):
            allowed = allowed | ((slots[:, a, None] == slots[None, :, b]) & (slots[:, a, None] >= 0))
    return allowed & (distance >= 0)


def dense_masked_attention(q, k, v, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention over the pairs of ``mask`` [Tq, Tk] computed in ``dtype`` by plain PyTorch (differentiable).
    q [1, Hq, Tq, D]; k, v [1, Hkv, Tk, D]."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.to(dtype).repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.to(dtype) @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values


def check_gradients(focus_fn: Callable, q, k, v, groups, window: int) -> Verdict:
    """Gate of the backward pass: dq, dk, dv of ``focus_fn(q, k, v, groups)`` against dense masked attention, each
    with the forward rule applied to the whole gradient tensor. Builds a [T, T] mask: use a short T."""
    mask = focus_mask(groups, window)
    grad_out = torch.randn_like(q)

    def grads(attn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attn(*leaves)
        return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))

    tested = grads(lambda *x: focus_fn(*x, groups))
    exact = grads(lambda *x: dense_masked_attention(*x, mask, torch.float32))
    low = grads(lambda *x: dense_masked_attention(*x, mask, DTYPE))
    pairs = [tolerance_ratio(t, e, l) for t, e, l in zip(tested, exact, low)]
    return verdict(pairs, f"dq, dk, dv at T={q.shape[2]}")


# ---------------------------------------------------------------------------------------------------- measuring

def skipped(reason: str) -> dict:
    return {"ms": None, "reps": 0, "peak_gb": None, "reason": reason}


def describe(error: Exception) -> str:
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    lines = str(error).strip().splitlines()
    return f"failed: {type(error).__name__}: {lines[0][:200] if lines else ''}"


class Bench:
    """Measures calls, remembering each method's last time per key so that a call predicted to exceed
    ``max_call_s`` is skipped, and a method that failed (out of memory, unsupported) is not tried again."""

    def __init__(self, config: BenchConfig, focus_fn: Optional[Callable] = None):
        self.config = config
        self.device = torch.device(config.device)
        self.focus_fn = focus_fn or functools.partial(focus_ops.focus_attention, window=config.window, causal=True,
                                                      backend=config.backend)
        self.last: dict[tuple, tuple[int, float]] = {}
        self.dead: dict[tuple, str] = {}
        self.gradient_verdicts: dict[tuple, Optional[Verdict]] = {}

    def predicted_ms(self, key: tuple, length: int, power: int) -> float:
        if key not in self.last:
            return 0.0
        shorter, ms = self.last[key]
        return ms * (length / shorter) ** power

    def time(self, key: tuple, length: int, make: Callable[[], Callable], *, power: int = 2,
             gate: Optional[Callable] = None, compiled: bool = False) -> tuple[dict, Optional[Verdict]]:
        """Measures the call built by ``make()``. With ``gate``, the call's first output must pass it first
        (``gate(out) -> Verdict``); a failed gate gives no time. Returns (measurement dict, verdict or None)."""
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
            timing = measure(call, self.device, warmup=warmup, reps=self.config.reps, budget_s=self.config.budget_s)
        except Exception as error:  # noqa: BLE001 - any failure of a method is a result to record, not a crash
            self.dead[key] = f"{describe(error)} at T={length}"
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return skipped(self.dead[key]), checked
        self.last[key] = (length, timing.ms)
        return {"ms": timing.ms, "reps": timing.reps, "peak_gb": timing.peak_gb, "reason": None}, checked

    def backend_used(self, q, k, groups) -> tuple[str, Optional[str]]:
        """(backend, reason) that focus_attention resolves to, when the op can say; else (the requested one, None).
        A backend that cannot serve the call reads "unavailable" with the op's reason."""
        if not hasattr(focus_ops, "focus_backend"):
            return self.config.backend, None
        try:
            return focus_ops.focus_backend(q, k, groups, causal=True, backend=self.config.backend)
        except ValueError as error:
            return "unavailable", str(error)

    def backward_verdict(self, head_dim: int, num_groups: int, top_k: int) -> Optional[Verdict]:
        """The gradient gate for this (D, K, top-k), run once at ``backward_gate_length`` (or shorter). None when
        the Focus backward cannot run; its timing key is then marked failed, with the reason."""
        key = (head_dim, num_groups, top_k)
        if key not in self.gradient_verdicts:
            c = self.config
            length = min(c.backward_gate_length, max(c.lengths))
            q, k, v = make_qkv(c.heads, c.heads, length, length, head_dim, self.device, c.seed + 1)
            groups = balanced_groups(length, num_groups, top_k, seed=c.seed + 1).to(self.device)
            try:
                self.gradient_verdicts[key] = check_gradients(self.focus_fn, q, k, v, groups, c.window)
            except Exception as error:  # noqa: BLE001 - recorded like any failed call
                self.gradient_verdicts[key] = None
                self.dead[("focus", BACKWARD, *key)] = f"{describe(error)} in the gradient check at T={length}"
        return self.gradient_verdicts[key]


def speedups(focus: dict, baselines: dict) -> dict:
    return {name: (b["ms"] / focus["ms"] if b["ms"] is not None and focus["ms"] is not None else None)
            for name, b in baselines.items()}


def focus_row(bench: Bench, mode: str, q, k, v, groups, num_groups: int, top_k: int, focus: dict,
              checked: Optional[Verdict], baselines: dict) -> dict:
    """One result row; ``correct`` is None when the Focus call never got to its gate."""
    backend, reason = bench.backend_used(q, k, groups)
    return {"mode": mode, "T": k.shape[2], "head_dim": q.shape[3], "heads": q.shape[1], "kv_heads": k.shape[1],
            "num_groups": num_groups, "top_k": top_k, "window": bench.config.window, "focus_backend": backend,
            "focus_backend_reason": reason, "correct": None if checked is None else checked.passed,
            "gate": None if checked is None else asdict(checked), "focus": focus, "baselines": baselines,
            "speedup": speedups(focus, baselines)}


def dense_prefill(bench: Bench, mode: str, q, k, v) -> dict:
    """The requested dense baselines (cudnn, flash, flex) for one (T, D): they do not depend on the groups."""
    length, backward = q.shape[2], mode == BACKWARD
    makers = {"cudnn": lambda: functools.partial(sdpa, backend="cudnn", causal=True),
              "flash": lambda: functools.partial(sdpa, backend="flash", causal=True),
              "flex": lambda: flex_causal(length, q.device)}
    results = {}
    for name in (n for n in ("cudnn", "flash", "flex") if n in bench.config.baselines):
        def make(name=name):
            attn = makers[name]()
            return forward_backward(attn, q, k, v) if backward else functools.partial(attn, q, k, v)
        results[name] = bench.time((name, mode, q.shape[3]), length, make, compiled=name == "flex")[0]
    return results


def prefill_rows(bench: Bench, mode: str, q, k, v) -> list[dict]:
    """Rows of one (T, D) in ``mode`` (forward or forward+backward), one per (K, top-k)."""
    c, length, dim = bench.config, q.shape[2], q.shape[3]
    backward = mode == BACKWARD
    dense = dense_prefill(bench, mode, q, k, v)
    rows = []
    for num_groups in c.group_counts:
        for top_k in c.top_ks:
            groups = balanced_groups(length, num_groups, top_k, seed=c.seed).to(bench.device)
            key = (mode, dim, num_groups, top_k)

            def attn(q_, k_, v_):
                return bench.focus_fn(q_, k_, v_, groups)

            if backward:
                checked = bench.backward_verdict(dim, num_groups, top_k)
                focus = (skipped("failed the correctness gate") if checked is not None and not checked.passed
                         else bench.time(("focus", *key), length, lambda: forward_backward(attn, q, k, v))[0])
            else:
                rows_checked = sample_rows(length, c.window, c.gate_rows, c.seed)
                focus, checked = bench.time(("focus", *key), length, lambda: functools.partial(attn, q, k, v),
                                            gate=lambda out: check_rows(out, q, k, v, groups, rows_checked, c.window))
            baselines = dict(dense)
            if "prototype" in c.baselines:
                proto = functools.partial(prototype_same_group, groups=groups, num_groups=num_groups)
                baselines["prototype"] = bench.time(
                    ("prototype", *key), length,
                    lambda: forward_backward(proto, q, k, v) if backward else functools.partial(proto, q, k, v))[0]
            rows.append(focus_row(bench, mode, q, k, v, groups, num_groups, top_k, focus, checked, baselines))
            print(format_row(rows[-1]), flush=True)
    return rows


def decode_rows(bench: Bench, cache_len: int, head_dim: int) -> list[dict]:
    """One-token decode over a cache of ``cache_len``: Focus (Tq=1) per (K, top-k) against dense SDPA."""
    c = bench.config
    q_heads, kv_heads = c.decode_heads
    q, k, v = make_qkv(q_heads, kv_heads, 1, cache_len, head_dim, bench.device, c.seed)
    dense_key = ("sdpa", DECODE, head_dim)
    backend = None
    if dense_key not in bench.dead:
        try:
            backend = first_working_sdpa(q, k, v, causal=False)
        except RuntimeError as error:
            bench.dead[dense_key] = describe(error)
    dense, _ = bench.time(dense_key, cache_len, lambda: functools.partial(sdpa, q, k, v, backend, causal=False),
                          power=1)
    dense["backend"] = backend
    rows = []
    for num_groups in c.group_counts:
        for top_k in c.top_ks:
            groups = balanced_groups(cache_len, num_groups, top_k, seed=c.seed).to(bench.device)
            # A decoder keeps its cache's routing validated (as a composed model's layers do), so a step pays
            # for attention, not for re-validating every cached token's groups.
            cached = FocusGroups.of(groups, 1, cache_len, bench.device)
            focus, checked = bench.time(
                ("focus", DECODE, head_dim, num_groups, top_k), cache_len,
                lambda: functools.partial(bench.focus_fn, q, k, v, cached), power=1,
                gate=lambda out: check_rows(out, q, k, v, groups, torch.tensor([0]), c.window))
            rows.append(focus_row(bench, DECODE, q, k, v, groups, num_groups, top_k, focus, checked,
                                  {"sdpa": dense}))
            print(format_row(rows[-1]), flush=True)
    return rows


def run(config: BenchConfig, focus_fn: Optional[Callable] = None) -> list[dict]:
    """Every row of the benchmark, printed as it completes. ``focus_fn(q, k, v, groups)`` replaces the Focus call
    (default: focus_attention with the configured window and backend)."""
    bench = Bench(config, focus_fn)
    print(TABLE_HEADER, flush=True)
    rows = []
    for head_dim in config.head_dims:
        for length in config.lengths:
            q, k, v = make_qkv(config.heads, config.heads, length, length, head_dim, bench.device, config.seed)
            rows += prefill_rows(bench, FORWARD, q, k, v)
            if config.backward and length <= config.max_backward_length:
                rows += prefill_rows(bench, BACKWARD, q, k, v)
            del q, k, v
        for cache_len in config.decode_lengths:
            rows += decode_rows(bench, cache_len, head_dim)
    return rows


# ---------------------------------------------------------------------------------------------------- reporting

TABLE_HEADER = ("| mode | T | D | K | top-k | focus ms | cuDNN ms | x cuDNN | x flash | x flex | x proto | peak GB "
                "| correct |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _number(value, digits: int = 3, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def format_length(length: int) -> str:
    for unit, size in (("M", 2 ** 20), ("K", 2 ** 10)):
        if length % size == 0:
            return f"{length // size}{unit}"
    return str(length)


def format_row(row: dict) -> str:
    """One markdown table line. Decode rows show dense SDPA (its backend named when not cuDNN) under cuDNN."""
    dense = row["baselines"].get("cudnn") or row["baselines"].get("sdpa") or skipped("not requested")
    dense_ms = _number(dense["ms"])
    if dense.get("backend") not in (None, "cudnn"):
        dense_ms += f" ({dense['backend']})"
    ratio = row["speedup"]
    dense_ratio = ratio.get("cudnn", ratio.get("sdpa"))
    correct = {True: "ok", False: "FAIL", None: "-"}[row["correct"]]
    cells = [row["mode"], format_length(row["T"]), row["head_dim"], row["num_groups"], row["top_k"],
             _number(row["focus"]["ms"]), dense_ms, _number(dense_ratio, 2, "x"),
             _number(ratio.get("flash"), 2, "x"), _number(ratio.get("flex"), 2, "x"),
             _number(ratio.get("prototype"), 2, "x"), _number(row["focus"]["peak_gb"], 2), correct]
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def git_commit() -> Optional[str]:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def environment(device: torch.device) -> dict:
    """Device and software versions of this run."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "python": platform.python_version(),
            "commit": git_commit()}


def plot_speedups(rows: list[dict], path: Path) -> Path:
    """PNG of Focus's speedup over dense cuDNN against T (log x), one panel per mode, one line per (D, K, top-k);
    dashed lines are the prototype's speedup over cuDNN. Decode panels compare with dense SDPA decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in (FORWARD, BACKWARD, DECODE) if any(r["mode"] == m for r in rows)] or [FORWARD]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        _plot_mode(ax, [r for r in rows if r["mode"] == mode], mode)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_mode(ax, rows: list[dict], mode: str) -> None:
    import matplotlib.ticker

    dense = "sdpa" if mode == DECODE else "cudnn"
    series = sorted({(r["head_dim"], r["num_groups"], r["top_k"]) for r in rows})
    for index, (dim, num_groups, top_k) in enumerate(series):
        mine = sorted((r for r in rows if (r["head_dim"], r["num_groups"], r["top_k"]) == (dim, num_groups, top_k)),
                      key=lambda r: r["T"])
        color = f"C{index % 10}"
        label = f"K={num_groups} top-{top_k}" + (f" D={dim}" if len({s[0] for s in series}) > 1 else "")
        focus = [(r["T"], r["speedup"][dense]) for r in mine if r["speedup"].get(dense) is not None]
        if focus:
            ax.plot(*zip(*focus), marker="o", color=color, label=label)
        proto = [(r["T"], r["baselines"][dense]["ms"] / r["baselines"]["prototype"]["ms"]) for r in mine
                 if r["baselines"].get("prototype", {}).get("ms") and r["baselines"].get(dense, {}).get("ms")]
        if proto:
            ax.plot(*zip(*proto), linestyle="--", color=color, label=f"{label} prototype")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    # Speedups span 0.01x (a reference backend) to 10x and more: only a log scale shows both.
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    lengths = sorted({r["T"] for r in rows})
    ax.set_xticks(lengths, [format_length(t) for t in lengths])
    ax.minorticks_off()
    ax.set_xlabel("cached tokens" if mode == DECODE else "sequence length T")
    ax.set_ylabel(f"speedup over dense {'SDPA decode' if mode == DECODE else 'cuDNN'}")
    ax.set_title(f"Focus {mode}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speedup measured", transform=ax.transAxes, ha="center")


def main(args: argparse.Namespace) -> int:
    """Runs ``sieve bench focus``; writes OUT/bench_focus.json and OUT/speedup_vs_length.png."""
    config = config_from_args(args)
    rows = run(config)
    record = {"environment": environment(torch.device(config.device)), "settings": asdict(config), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "bench_focus.json"
    json_path.write_text(json.dumps(record, indent=2))
    plot_path = plot_speedups(rows, args.out / "speedup_vs_length.png")
    failed = sum(row["correct"] is False for row in rows)
    print(f"wrote {json_path} and {plot_path}" + (f"; {failed} configuration(s) FAILED the gate" if failed else ""))
    return 1 if failed else 0
