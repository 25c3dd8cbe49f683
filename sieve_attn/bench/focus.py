"""``sieve bench focus``: Focus attention against dense attention kernels, every configuration checked first.

Inputs are random bf16 q, k, v (B=1) and random balanced groups. Each Focus configuration passes a correctness gate
in the same run before its time is reported; a configuration that fails prints FAIL and reports no speed.

``--backend`` is the Focus backend of every row. ``--backends`` adds, in prefill (forward and forward+backward), one
more row per configuration for each further backend (default none): timed and gated the
same way, on the same inputs, against the same baselines, and marked by the row's ``extra_backend`` (rows of
``--backend`` have no such field). Decode rows are only measured for ``--backend``.

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
attention over them is done in float32, and again in bf16 as plain PyTorch would. A row passes the rule of
:mod:`.common`: max|focus - fp32| <= 2 * max|bf16 - fp32| + 2**-8 * max|fp32|. Backward is gated once per
(D, K, top-k) at a short length (``backward_gate_length``): dq, dk, dv of the Focus call against a dense masked
attention built from the definition, with the same rule per gradient.

Calls predicted to run too long, or whose method failed at a shorter length, are skipped as :mod:`.common` says.
"""
from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from ..ops.focus import attention as focus_ops
from ..ops.focus.groups import FocusGroups
from .common import (BACKWARD, DECODE, Settings, Timer, Verdict, add_bench_arguments, add_int_list, attend_row,
                     check_sampled_rows, choice_list, decode_inputs, dense_baseline, dense_cells, dense_labels,
                     dense_masked_attention, finish,
                     format_length, forward_backward, gate_cell, gradient_gate, make_qkv, markdown_row, number,
                     parse_length, plot_modes, plot_ratio, Record, refuse_above, row_fields, sample_rows, sdpa,
                     settings_from_args, speedup_axis, speedups, sweep, table_header, time_dense)

# The module's interface; parse_length, format_length and sample_rows live in .common and stay importable here.
__all__ = ["BenchConfig", "add_arguments", "balanced_groups", "check_rows", "format_length", "main", "parse_length",
           "prototype_same_group", "run", "sample_rows"]

BASELINES = ("cudnn", "flash", "flex", "prototype")
SPREADS = ("combinations", "adjacent")  # of balanced_groups
EXTRA_BACKENDS = tuple(name for name in focus_ops.BACKENDS if name != "auto")


@dataclass(frozen=True)
class BenchConfig(Settings):
    """Everything one run measures, saved with the results; the defaults are the command's."""
    baselines: tuple[str, ...] = BASELINES
    group_counts: tuple[int, ...] = (4, 8, 16)
    top_ks: tuple[int, ...] = (1, 2)
    window: int = 128
    spread: str = "combinations"
    extra_backends: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------- arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``sieve bench focus``."""
    d = BenchConfig()

    def add_focus_arguments(group) -> None:
        add_int_list(group, "--groups", d.group_counts, "group counts K, comma list; random groups of balanced sizes")
        add_int_list(group, "--top-k", d.top_ks, "groups per token, comma list; each must be <= every K")
        group.add_argument("--window", type=int, default=d.window, help=f"local window w: 0 <= i-j <= w ({d.window})")
        group.add_argument("--spread", choices=SPREADS, default=d.spread,
                           help="how a token's top-k groups are drawn: combinations (every set of top-k distinct "
                                "groups dealt equally often, so every pair of groups is equally common) or adjacent "
                                "(the sets {g, g+1, ..}, only K of them; the bench's groups up to Focus v10) "
                                f"({d.spread})")
        group.add_argument("--backends", type=choice_list(EXTRA_BACKENDS), default=(),
                           help="further focus_attention backends timed in extra prefill rows, comma list (none)")

    add_bench_arguments(
        parser, d, method="Focus pattern", add_method_arguments=add_focus_arguments, backends=focus_ops.BACKENDS,
        backend_help="focus_attention backend under test", baselines=BASELINES,
        baselines_help="comma list of cudnn, flash (dense causal SDPA), flex (compiled FlexAttention), prototype "
                       "(sorted, padded same-group SDPA-cuDNN without the window) (all)",
        out=Path("runs") / "bench_focus", files="bench_focus.json and speedup_vs_length.png")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's settings; exits, before anything is timed, on a top-k above a group count, a negative window,
    or group sets the "combinations" spread cannot deal."""
    refuse_above("--top-k", args.top_k, "--groups", args.groups)
    if args.window < 0:
        raise SystemExit(f"--window: expected an int >= 0, got {args.window}")
    too_many = [(k, top_k) for k in args.groups for top_k in args.top_k
                if args.spread == "combinations" and math.comb(k, top_k) > MAX_COMBINATIONS]
    if too_many:
        k, top_k = too_many[0]
        raise SystemExit(f"--spread: 'combinations' deals all C(K={k}, top-k={top_k}) = {math.comb(k, top_k)} group "
                         f"sets, expected at most {MAX_COMBINATIONS} (fewer --groups, or --spread adjacent)")
    extra = args.backends or ()
    return BenchConfig(**settings_from_args(args), group_counts=args.groups, top_ks=args.top_k, window=args.window,
                       spread=args.spread,
                       extra_backends=tuple(name for name in extra if name != args.backend))


# ---------------------------------------------------------------------------------------------------- inputs

# Sets of groups dealt out by the "combinations" spread: C(K, top_k) must stay a table the bench can hold.
MAX_COMBINATIONS = 1 << 20


def balanced_groups(length: int, num_groups: int, top_k: int, *, seed: int = 0,
                    spread: str = "combinations") -> torch.Tensor:
    """Random groups of balanced sizes: int64 [1, length, top_k] on the CPU, a token's ids distinct and ascending
    ("combinations") or in slot order ("adjacent").

    A random permutation of the tokens is dealt round-robin over a table of group sets:
    - ``"combinations"``: every set of ``top_k`` distinct groups (C(K, top_k) of them, in a random order), so every
      pair of groups is equally common; each group is in the same number of sets, so group sizes differ by at most
      C(K - 1, top_k - 1) tokens (0 when C(K, top_k) divides ``length``). With top_k = 1 both spreads are the same
      dealing of single groups, balanced to within one token.
    - ``"adjacent"``: the sets {g, g + 1, ..., g + top_k - 1} (mod K): only K sets, every slot balanced to within
      one token (the bench's groups up to Focus v10).
    """
    if not 1 <= top_k <= num_groups:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_groups={num_groups}, got {top_k}")
    if spread not in SPREADS:
        raise ValueError(f"spread: expected one of {SPREADS}, got {spread!r}")
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(length, generator=generator)
    if spread == "adjacent" or top_k == 1:
        table = (torch.arange(num_groups)[:, None] + torch.arange(top_k)) % num_groups
    else:
        if math.comb(num_groups, top_k) > MAX_COMBINATIONS:
            raise ValueError(f"spread: 'combinations' deals all C(K={num_groups}, top_k={top_k}) = "
                             f"{math.comb(num_groups, top_k)} sets, expected at most {MAX_COMBINATIONS}; "
                             "use 'adjacent'")
        table = torch.combinations(torch.arange(num_groups), top_k)
        table = table[torch.randperm(table.shape[0], generator=generator)]
    dealt = torch.empty(length, dtype=torch.long)
    dealt[perm] = torch.arange(length) % table.shape[0]
    return table[dealt][None]


# ---------------------------------------------------------------------------------------------------- baselines

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


# ---------------------------------------------------------------------------------------------------- gate

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
    keys = attended_keys(groups, k.shape[2] - q.shape[2] + row, window)
    return attend_row(q[0, :, row], k[0][:, keys], v[0][:, keys], dtype)


def check_rows(out: torch.Tensor, q, k, v, groups, rows: torch.Tensor, window: int) -> Verdict:
    """Gate of a forward output ``out`` [1, Hq, Tq, D] on the query rows ``rows`` (see the module docstring)."""
    return check_sampled_rows(out, rows, lambda row, dtype: exact_row(q, k, v, groups, row, window, dtype))


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


def check_gradients(focus_fn: Callable, q, k, v, groups, window: int) -> Verdict:
    """Gate of the backward pass: dq, dk, dv of ``focus_fn(q, k, v, groups)`` against dense masked attention, each
    with the forward rule applied to the whole gradient tensor. Builds a [T, T] mask: use a short T."""
    reference = functools.partial(dense_masked_attention, mask=focus_mask(groups, window))
    return gradient_gate(lambda *x: focus_fn(*x, groups), reference, q, k, v)


# ---------------------------------------------------------------------------------------------------- measuring

class Bench(Timer):
    """The :class:`Timer` of a Focus run, with the Focus calls under test and their gradient gates. ``fns`` maps
    None (the configured backend, or the given ``focus_fn``) and each extra backend to its call."""

    def __init__(self, config: BenchConfig, focus_fn: Optional[Callable] = None):
        super().__init__(config)
        self.fns = {name: functools.partial(focus_ops.focus_attention, window=config.window, causal=True,
                                            backend=name or config.backend)
                    for name in (None, *config.extra_backends)}
        self.custom = focus_fn is not None
        if focus_fn is not None:
            self.fns[None] = focus_fn
        self.focus_fn = self.fns[None]

    def backend_used(self, q, k, groups, mode: str, extra: Optional[str] = None) -> tuple[str, Optional[str]]:
        """(backend, reason) that focus_attention resolves to for the configured backend (or ``extra``) in ``mode``
        (forward+backward asks gradients of q, k, v, which ``auto`` weighs), when the op can say; else (the requested
        one, None). A backend that cannot serve the call reads "unavailable" with the op's reason."""
        requested = extra or self.config.backend
        if not hasattr(focus_ops, "focus_backend"):
            return requested, None
        if mode == BACKWARD:
            q = q.detach().requires_grad_()
        try:
            return focus_ops.focus_backend(q, k, groups, causal=True, backend=requested)
        except ValueError as error:
            return "unavailable", str(error)

    def backward_verdict(self, head_dim: int, num_groups: int, top_k: int, extra: Optional[str] = None,
                         timed_backend: Optional[str] = None) -> Optional[Verdict]:
        """The gradient gate for this (D, K, top-k) of the configured backend (or ``extra``), run once per backend
        at ``backward_gate_length`` (or shorter). ``timed_backend``: the backend the timed call resolves to at its
        own length (:meth:`backend_used`), forced here, where ``auto`` could pick another (dense SDPA below 8K)
        and leave the timed backward unchecked. None when the Focus backward cannot run; its timing key is then
        marked failed, with the reason."""
        c = self.config
        length = min(c.backward_gate_length, max(c.lengths))
        forceable = timed_backend in focus_ops.BACKENDS and timed_backend != "auto"
        forced = timed_backend if forceable and not (self.custom and extra is None) else None
        fn = self.fns[extra] if forced is None else functools.partial(
            focus_ops.focus_attention, window=c.window, causal=True, backend=forced)

        def check() -> Verdict:
            q, k, v = make_qkv(c.heads, c.heads, length, length, head_dim, self.device, c.seed + 1)
            groups = balanced_groups(length, num_groups, top_k, seed=c.seed + 1, spread=c.spread).to(self.device)
            verdict = check_gradients(fn, q, k, v, groups, c.window)
            return replace(verdict, checked=f"{verdict.checked}, backend {forced}") if forced else verdict
        key = (extra, forced, head_dim, num_groups, top_k)
        return self.gradient_verdict(key, (timing_label(extra), BACKWARD, head_dim, num_groups, top_k), length,
                                     check)


def timing_label(extra: Optional[str]) -> str:
    """The timing-key label of the configured backend's Focus calls (``focus``) or of an extra backend's."""
    return f"focus:{extra}" if extra else "focus"


def focus_row(bench: Bench, mode: str, q, k, groups, num_groups: int, top_k: int, focus: dict,
              checked: Optional[Verdict], baselines: dict, extra: Optional[str] = None) -> dict:
    """One result row (of the configured backend, or of the extra backend ``extra``, named in ``extra_backend``);
    ``correct`` is None when the Focus call never got to its gate."""
    backend, reason = bench.backend_used(q, k, groups, mode, extra)
    row = {**row_fields(mode, q, k, checked), "num_groups": num_groups, "top_k": top_k,
           "window": bench.config.window, "focus_backend": backend, "focus_backend_reason": reason, "focus": focus,
           "baselines": baselines, "speedup": speedups(focus, baselines)}
    return {**row, "extra_backend": extra} if extra else row


def dense_prefill(bench: Bench, mode: str, q, k, v) -> dict:
    """The requested dense baselines (cudnn, flash, flex) for one (T, D): they do not depend on the groups."""
    makers = {"cudnn": lambda: functools.partial(sdpa, backend="cudnn", causal=True),
              "flash": lambda: functools.partial(sdpa, backend="flash", causal=True),
              "flex": lambda: flex_causal(q.shape[2], q.device)}
    requested = {name: make for name, make in makers.items() if name in bench.config.baselines}
    return time_dense(bench, mode, q, k, v, requested, compiled=("flex",))


def prefill_rows(bench: Bench, mode: str, q, k, v) -> list[dict]:
    """Rows of one (T, D) in ``mode`` (forward or forward+backward), one per (K, top-k)."""
    c, length, dim = bench.config, q.shape[2], q.shape[3]
    backward = mode == BACKWARD
    dense = dense_prefill(bench, mode, q, k, v)
    rows = []
    for num_groups in c.group_counts:
        for top_k in c.top_ks:
            groups = balanced_groups(length, num_groups, top_k, seed=c.seed, spread=c.spread).to(bench.device)
            key = (mode, dim, num_groups, top_k)
            focus, checked = time_focus(bench, None, mode, q, k, v, groups, num_groups, top_k)
            baselines = dict(dense)
            if "prototype" in c.baselines:
                proto = functools.partial(prototype_same_group, groups=groups, num_groups=num_groups)
                baselines["prototype"] = bench.time(
                    ("prototype", *key), length,
                    lambda: forward_backward(proto, q, k, v) if backward else functools.partial(proto, q, k, v),
                    graphable=not backward)[0]
            rows.append(focus_row(bench, mode, q, k, groups, num_groups, top_k, focus, checked, baselines))
            print(format_row(rows[-1]), flush=True)
            for extra in c.extra_backends:
                focus, checked = time_focus(bench, extra, mode, q, k, v, groups, num_groups, top_k)
                rows.append(focus_row(bench, mode, q, k, groups, num_groups, top_k, focus, checked, baselines, extra))
                print(format_row(rows[-1]), flush=True)
    return rows


def time_focus(bench: Bench, extra: Optional[str], mode: str, q, k, v, groups, num_groups: int,
               top_k: int) -> tuple[dict, Optional[Verdict]]:
    """(measurement, verdict) of the configured backend's Focus call (or the extra backend ``extra``'s) in ``mode``:
    the forward gated on sampled rows, forward+backward on the gradient gate of its (D, K, top-k)."""
    c, length, dim = bench.config, q.shape[2], q.shape[3]
    key = (timing_label(extra), mode, dim, num_groups, top_k)
    fn = bench.fns[extra]

    def attn(q_, k_, v_):
        # As a composed model passes its router's memberships: FocusGroups.routed, valid by construction (a raw id
        # tensor would be validated in every call, with a host read that a model never pays).
        return fn(q_, k_, v_, FocusGroups.routed(groups, num_groups))

    if mode == BACKWARD:
        timed_backend, _ = bench.backend_used(q, k, groups, BACKWARD, extra)
        checked = bench.backward_verdict(dim, num_groups, top_k, extra, timed_backend)
        return bench.time_backward(key, length, lambda: forward_backward(attn, q, k, v), checked), checked
    rows_checked = sample_rows(length, c.window, c.gate_rows, c.seed)
    return bench.time(key, length, lambda: functools.partial(attn, q, k, v), graphable=True,
                      gate=lambda out: check_rows(out, q, k, v, groups, rows_checked, c.window))


def decode_rows(bench: Bench, cache_len: int, head_dim: int) -> list[dict]:
    """One-token decode over a cache of ``cache_len``: Focus (Tq=1) per (K, top-k) against dense SDPA."""
    c = bench.config
    q, k, v, dense = decode_inputs(bench, cache_len, head_dim)
    rows = []
    for num_groups in c.group_counts:
        for top_k in c.top_ks:
            groups = balanced_groups(cache_len, num_groups, top_k, seed=c.seed, spread=c.spread).to(bench.device)
            # A decoder keeps its cache's routing validated (as a composed model's layers do), so a step pays
            # for attention, not for re-validating every cached token's groups.
            cached = FocusGroups.of(groups, 1, cache_len, bench.device)
            focus, checked = bench.time(
                ("focus", DECODE, head_dim, num_groups, top_k), cache_len,
                lambda: functools.partial(bench.focus_fn, q, k, v, cached), power=1, graphable=True,
                gate=lambda out: check_rows(out, q, k, v, groups, torch.tensor([0]), c.window))
            rows.append(focus_row(bench, DECODE, q, k, groups, num_groups, top_k, focus, checked,
                                  {"sdpa": dense}))
            print(format_row(rows[-1]), flush=True)
    return rows


def run(config: BenchConfig, focus_fn: Optional[Callable] = None,
        on_rows: Optional[Callable[[list], object]] = None) -> list[dict]:
    """Every row of the benchmark, printed as it completes (and handed to ``on_rows``, :func:`.common.sweep`).
    ``focus_fn(q, k, v, groups)`` replaces the Focus call (default: focus_attention with the configured window and
    backend)."""
    return sweep(Bench(config, focus_fn), TABLE_HEADER, prefill_rows, decode_rows, on_rows)


# ---------------------------------------------------------------------------------------------------- reporting

TABLE_HEADER = table_header(["mode", "T", "D", "K", "top-k", "backend", "focus ms", "cuDNN ms", "x cuDNN", "x flash",
                             "x flex", "x proto", "peak GB", "correct"])


def format_row(row: dict) -> str:
    """One markdown table line; ``backend`` is the one the Focus call resolved to. Decode rows show dense SDPA (its
    backend named when not cuDNN) under cuDNN."""
    ratio = row["speedup"]
    return markdown_row([row["mode"], format_length(row["T"]), row["head_dim"], row["num_groups"], row["top_k"],
                         row["focus_backend"], number(row["focus"]["ms"]), *dense_cells(row),
                         number(ratio.get("flash"), 2, "x"), number(ratio.get("flex"), 2, "x"),
                         number(ratio.get("prototype"), 2, "x"),
                         number(row["focus"]["peak_gb"], 2), gate_cell(row["correct"])])


def plot_speedups(rows: list[dict], path: Path) -> Path:
    """PNG of Focus's speedup over dense cuDNN against T (log x), one panel per mode, one line per (D, K, top-k) of
    the configured backend; dashed lines are the prototype's speedup over cuDNN, dotted ones each extra backend's.
    Decode panels compare with dense SDPA decode."""
    return plot_modes(rows, path, _plot_mode)


def _plot_mode(ax, rows: list[dict], mode: str) -> None:
    series = sorted({(r["head_dim"], r["num_groups"], r["top_k"]) for r in rows})
    extras = sorted({r["extra_backend"] for r in rows if r.get("extra_backend")})
    for index, (dim, num_groups, top_k) in enumerate(series):
        mine = [r for r in rows if (r["head_dim"], r["num_groups"], r["top_k"]) == (dim, num_groups, top_k)]
        color = f"C{index % 10}"
        label = f"K={num_groups} top-{top_k}" + (f" D={dim}" if len({s[0] for s in series}) > 1 else "")
        configured = [r for r in mine if not r.get("extra_backend")]
        plot_ratio(ax, configured, _dense_speedup, marker="o", color=color, label=label)
        plot_ratio(ax, configured, _prototype_speedup, linestyle="--", color=color, label=f"{label} prototype")
        for extra in extras:
            plot_ratio(ax, [r for r in mine if r.get("extra_backend") == extra], _dense_speedup,
                       marker="x", linestyle=":", color=color, label=f"{label} {extra}")
    speedup_axis(ax, rows, mode, f"speedup over dense {dense_labels(rows)}", f"Focus {mode}")


def _dense_speedup(row: dict) -> Optional[float]:
    return row["speedup"].get(dense_baseline(row))


def _prototype_speedup(row: dict) -> Optional[float]:
    """The prototype's speedup over the row's :func:`dense_baseline`, when both were timed."""
    dense = dense_baseline(row)
    proto = row["baselines"].get("prototype", {}).get("ms")
    base = None if dense is None else row["baselines"][dense].get("ms")
    return base / proto if proto and base else None


def main(args: argparse.Namespace) -> int:
    """Runs ``sieve bench focus``; writes OUT/bench_focus.json and OUT/speedup_vs_length.png."""
    config = config_from_args(args)
    record = Record(config, args.out, "bench_focus.json")
    return finish(record, run(config, on_rows=record.write), plot_speedups, "speedup_vs_length.png", method="focus")
