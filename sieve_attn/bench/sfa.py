"""``sieve bench sfa``: SFA attention against dense kernels, every configuration checked first.

The SFA calls run the ``--backend`` asked for (under "auto" on CUDA: sdpa for prefill, the Triton kernel for decode;
``--backend triton`` times the FlashSFA kernels); each row records the backend that ran and why.

Inputs are random bf16 q, k, v (B=1). Prefill times ``sfa_attention(q, k, v, topk=k, causal=True)`` (forward, and
forward+backward with ``backward``); decode times ``sfa_decode`` of one query token over an :class:`SFAKeyCache`
filled once, untimed, with the cache's keys and values.

Baselines, on the same inputs:
- ``cudnn``, ``flash``: dense causal SDPA with that backend forced;
- ``cuda-core``: :func:`sieve_attn.ops.sfa.flash_sfa.dense_cuda_core_attention`, dense attention with FlashSFA's
  forward tiling and its scores on CUDA cores (no tensor-core dots): the like-for-like comparison the paper makes.
  Forward only (its forward+backward reads "not applicable"), and timed on CUDA devices only;
- ``sdpa`` (decode only): dense SDPA over the dense K/V cache, cuDNN when it takes one query token, else the first
  of flash, efficient, math that does (the row records which).

Correctness gate, in the same run before any time is reported (rule in :mod:`.common`): about ``gate_rows`` query
rows (the first and last, some among the first ``EARLY_ROWS``, the rest at random) are computed from the definition:
q and k sparsified with :func:`sieve_attn.ops.sfa.codes.sparsify` (the selection rule every SFA path shares), causal
softmax attention over the dense V, in float32 (exact) and in bf16 (plain PyTorch's error). Decode checks its one
query row the same way over the whole cache. Backward is gated once per (D, k) at ``backward_gate_length``: dq, dk,
dv against autograd of a dense masked fp32 attention on the sparsified q and k (whose straight-through gradients
are SFA's). A failed gate prints FAIL, reports no time and sets ``correct: false``; the command then exits 1,
as it does when an SFA call raised (its row's ``reason``, printed at the end).

Work per row, so that a ratio can be explained: prefill counts FMAs over the causal pairs i >= j of every head,
k per pair for SFA's scores against D dense, and D for P @ V in both (forward+backward: 5 score-side and 4 value-side
products per pair, the FlashSFA kernels' accounting); decode counts the bytes read per cached token and KV head,
the k bit-packed indices (ceil(k * b / 8) bytes, b = max(1, ceil(log2 D))) + k values + D values of V for SFA against
2 * D values dense (in bf16 at D = 128, k = 16: 14 + 32 + 256 = 302 against 512).
The JSON also records the measured KV-cache bytes per token of :class:`SFAKeyCache` at each (D, k) against
:func:`dense_bytes_per_token`.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import SFA_BACKENDS, sfa_decode_backend
from ..ops.masked_sdpa import causal_mask
from ..ops.sfa.attention import sfa_attention, sfa_backend
from ..ops.sfa.cache import SFAKeyCache, dense_bytes_per_token, packed_bytes
from ..ops.sfa.codes import sparsify
from ..ops.sfa.decode import sfa_decode
from ..ops.triton_common import choose_backend, kernel_blocker
from .common import (BACKWARD, DECODE, DTYPE, FORWARD, Settings, Timer, Verdict, add_bench_arguments, add_int_list,
                     attend_row, check_sampled_rows, decode_inputs, dense_baseline, dense_cells, dense_labels,
                     dense_masked_attention, finish, format_length, forward_backward, gate_cell, gradient_gate,
                     make_qkv, markdown_row, number, plot_modes, plot_ratio, Record, refuse_above, row_fields,
                     sample_rows, sdpa, settings_from_args, skipped, speedup_axis, speedups, sweep, table_header,
                     time_dense)

BASELINES = ("cudnn", "flash", "cuda-core")
# The gate samples an eighth of its rows among the first EARLY_ROWS queries: they attend the fewest keys, and they fill
# FlashSFA's first two query tiles on CUDA (64 rows each), where most key tiles straddle the causal diagonal.
EARLY_ROWS = 128
# Forward+backward products per causal pair, in units of the forward's: score side (S forward; S in both backward
# kernels, dq, dk) and value side (P @ V forward; dP in both backward kernels, dV). See flash_sfa's docstring.
_SCORE_PASSES = {FORWARD: 1, BACKWARD: 5}
_VALUE_PASSES = {FORWARD: 1, BACKWARD: 4}


@dataclass(frozen=True)
class BenchConfig(Settings):
    """Everything one run measures, saved with the results; the defaults are the command's."""
    lengths: tuple[int, ...] = tuple(2 ** p for p in range(12, 18))  # 4K ... 128K
    head_dims: tuple[int, ...] = (64, 128)
    baselines: tuple[str, ...] = BASELINES
    max_backward_length: int = 128 * 1024
    backward_gate_length: int = 2048
    top_ks: tuple[int, ...] = (8, 16)


# ---------------------------------------------------------------------------------------------------- arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``sieve bench sfa``."""
    d = BenchConfig()

    def add_sfa_arguments(group) -> None:
        add_int_list(group, "--topk", d.top_ks,
                     "coordinates of q and k kept per token and head (SFA's k), comma list; each must be <= every D")

    add_bench_arguments(
        parser, d, method="SFA", add_method_arguments=add_sfa_arguments, backends=SFA_BACKENDS,
        backend_help="backend of sfa_attention and sfa_decode under test: triton (the FlashSFA kernels), sdpa (dense "
                     "SDPA on the zero-filled codes; decode then runs as auto), reference (PyTorch) or auto (on "
                     "CUDA: sdpa for prefill, the faster on the H200, and the Triton kernel for decode)",
        baselines=BASELINES,
        baselines_help="comma list of cudnn, flash (dense causal SDPA with that backend), cuda-core (dense attention "
                       "with FlashSFA's tiling and its scores on CUDA cores, the paper's like-for-like baseline; "
                       "forward only, CUDA only) (all); decode always compares with dense SDPA decode",
        out=Path("runs") / "bench_sfa", files="bench_sfa.json and sfa_speedup_vs_length.png")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    refuse_above("--topk", args.topk, "--head-dims", args.head_dims)
    return BenchConfig(**settings_from_args(args), top_ks=args.topk)


# ---------------------------------------------------------------------------------------------------- gate

def exact_row(q_sparse, k_sparse, v, row: int, dtype: torch.dtype) -> torch.Tensor:
    """SFA attention of query row ``row`` from the definition, computed in ``dtype``: [Hq, D]. q_sparse
    [1, Hq, Tq, D] and k_sparse [1, Hkv, Tk, D] are the sparsified q and k, v [1, Hkv, Tk, D] dense; the row sits at
    key position Tk - Tq + row and attends every key at or before it."""
    position = k_sparse.shape[2] - q_sparse.shape[2] + row
    return attend_row(q_sparse[0, :, row], k_sparse[0, :, :position + 1], v[0, :, :position + 1], dtype)


def check_rows(out: torch.Tensor, q, k, v, topk: int, rows: torch.Tensor) -> Verdict:
    """Gate of an SFA output ``out`` [1, Hq, Tq, D] of q, k, v on the query rows ``rows``."""
    return check_sampled_rows(out, rows, functools.partial(exact_row, sparsify(q, topk), sparsify(k, topk), v))


def sparse_causal_attention(q, k, v, *, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """SFA as dense masked attention on the sparsified q and k, in ``dtype`` (differentiable; builds a Tq x Tk mask,
    so short lengths only). q [1, Hq, Tq, D]; k, v [1, Hkv, Tk, D]."""
    mask = causal_mask(q.shape[2], k.shape[2], q.device)
    return dense_masked_attention(sparsify(q, topk), sparsify(k, topk), v, mask, dtype)


def check_gradients(sfa_fn: Callable, q, k, v, topk: int) -> Verdict:
    """Gate of the backward pass of ``sfa_fn(q, k, v, topk=topk)`` against :func:`sparse_causal_attention`."""
    return gradient_gate(functools.partial(sfa_fn, topk=topk),
                         functools.partial(sparse_causal_attention, topk=topk), q, k, v)


# ---------------------------------------------------------------------------------------------------- work

def prefill_work(mode: str, heads: int, length: int, head_dim: int, topk: int) -> dict:
    """FMAs of causal prefill at T = ``length`` over ``heads`` heads, counted per attended pair (i >= j): scores
    take ``topk`` FMAs a pair in SFA and ``head_dim`` dense, P @ V ``head_dim`` in both; forward+backward multiplies
    them by the passes of ``_SCORE_PASSES`` and ``_VALUE_PASSES``. FLOPs are twice the FMAs."""
    pairs = heads * length * (length + 1) // 2
    score, value = _SCORE_PASSES[mode], _VALUE_PASSES[mode]
    sfa, dense = score * topk + value * head_dim, (score + value) * head_dim
    return {"pairs": pairs, "sfa_score_fma_per_pair": score * topk, "dense_score_fma_per_pair": score * head_dim,
            "value_fma_per_pair": value * head_dim, "sfa_flops": 2 * pairs * sfa, "dense_flops": 2 * pairs * dense,
            "dense_over_sfa": dense / sfa}


def decode_work(kv_heads: int, length: int, head_dim: int, topk: int) -> dict:
    """Bytes one decode step reads from a cache of ``length`` tokens and ``kv_heads`` heads: per token and head,
    ``topk`` (index, value) pairs and the V row for SFA, the K and V rows dense (bf16 values, indices bit-packed as
    the cache stores them: :func:`packed_bytes` per key)."""
    value_bytes = DTYPE.itemsize
    sfa = packed_bytes(topk, head_dim) + topk * value_bytes + head_dim * value_bytes
    dense = 2 * head_dim * value_bytes
    return {"sfa_bytes_per_token": sfa, "dense_bytes_per_token": dense, "sfa_bytes": sfa * kv_heads * length,
            "dense_bytes": dense * kv_heads * length, "dense_over_sfa": dense / sfa}


# A decode cache's size class (the bench's shortest decode length).
_MEASURED_CAPACITY = 8192


def cache_bytes(head_dims: tuple[int, ...], top_ks: tuple[int, ...]) -> list[dict]:
    """Measured bytes per token and KV head of an :class:`SFAKeyCache` (bf16) at each (D, k), against a dense K+V
    cache, measured on a CPU cache of ``_MEASURED_CAPACITY`` tokens (the ratio does not depend on the device). The
    length matters only through the padding that puts each head's packed indices on 4-byte words: at most 3 bytes
    per head, none at an even capacity (as every cache that starts at the default capacity and doubles has) with
    an even number of packed bytes per key."""
    entries = []
    for head_dim in head_dims:
        dense = dense_bytes_per_token(head_dim, DTYPE)
        for topk in (k for k in top_ks if k <= head_dim):
            sfa = SFAKeyCache(1, 1, head_dim, topk=topk, dtype=DTYPE,
                              capacity=_MEASURED_CAPACITY).bytes_per_token()
            entries.append({"head_dim": head_dim, "topk": topk, "sfa_bytes_per_token": sfa,
                            "dense_bytes_per_token": dense, "sfa_over_dense": sfa / dense})
    return entries


# ---------------------------------------------------------------------------------------------------- measuring

class Bench(Timer):
    """The :class:`Timer` of an SFA run, with the SFA calls under test and their gradient gates."""

    def __init__(self, config: BenchConfig):
        super().__init__(config)
        self.sfa_fn = functools.partial(sfa_attention, causal=True, backend=config.backend)
        self.decode_backend = sfa_decode_backend(config.backend)
        self.decode_fn = functools.partial(sfa_decode, backend=self.decode_backend)

    def backend_used(self, q, mode: str) -> tuple[str, Optional[str]]:
        """(backend, why) that sfa_attention (or sfa_decode, for ``mode`` DECODE) resolves to for q (the bench's
        calls: causal, no softcap, no mask, no log-sum-exp); "unavailable", with the reason, when the requested
        backend cannot take the call."""
        if mode != DECODE:
            try:
                return sfa_backend(q, backend=self.config.backend)
            except ValueError as error:
                return "unavailable", str(error)
        requested = self.decode_backend
        blocker = kernel_blocker(q)
        try:
            backend = choose_backend(requested, q, blocker)
        except ValueError as error:
            return "unavailable", str(error)
        if requested != "auto":
            return backend, "requested"
        if backend == "triton":
            return backend, "auto: the Triton decode kernel takes the call"
        return backend, blocker or f"auto takes the Triton decode kernel on CUDA only, q is on {q.device}"

    def backward_verdict(self, head_dim: int, topk: int) -> Optional[Verdict]:
        """The gradient gate for this (D, k), run once at ``backward_gate_length`` (or shorter). None when the SFA
        backward cannot run; its timing key is then marked failed, with the reason."""
        c = self.config
        length = min(c.backward_gate_length, max(c.lengths))

        def check() -> Verdict:
            q, k, v = make_qkv(c.heads, c.heads, length, length, head_dim, self.device, c.seed + 1)
            return check_gradients(self.sfa_fn, q, k, v, topk)
        return self.gradient_verdict((head_dim, topk), ("sfa", BACKWARD, head_dim, topk), length, check)


def cuda_core(q, k, v) -> torch.Tensor:
    """The ``cuda-core`` baseline's output [1, H, T, D] (q [1, H, T, D], k, v [1, Hkv, T, D]). Imported here, as
    sfa_attention imports FlashSFA: that module needs triton, which a CPU install may lack."""
    from ..ops.sfa.flash_sfa import dense_cuda_core_attention

    return dense_cuda_core_attention(q, k, v, causal=True)[0]


def cuda_core_blocker(q) -> Optional[str]:
    """Why the cuda-core baseline is not timed for q, or None. The Triton interpreter could run it on the CPU, but
    timing an interpreter says nothing."""
    if q.device.type != "cuda":
        return f"unavailable: the CUDA-core kernel is timed on CUDA devices only, q is on {q.device}"
    blocker = kernel_blocker(q)
    return None if blocker is None else f"unavailable: {blocker}"


def dense_prefill(bench: Bench, mode: str, q, k, v) -> dict:
    """The requested dense baselines for one (T, D): they do not depend on topk."""
    requested = bench.config.baselines
    makers = {"cudnn": lambda: functools.partial(sdpa, backend="cudnn", causal=True),
              "flash": lambda: functools.partial(sdpa, backend="flash", causal=True)}
    results = time_dense(bench, mode, q, k, v, {name: make for name, make in makers.items() if name in requested})
    if "cuda-core" in requested and mode == BACKWARD:
        results["cuda-core"] = skipped("not applicable: the CUDA-core kernel is forward only")
    elif "cuda-core" in requested:
        key = ("cuda-core", FORWARD, q.shape[3])
        blocker = cuda_core_blocker(q)
        if blocker:
            bench.dead.setdefault(key, blocker)
        results["cuda-core"] = bench.time(key, q.shape[2], lambda: functools.partial(cuda_core, q, k, v),
                                          graphable=True)[0]
    return results


def sfa_row(bench: Bench, mode: str, q, k, topk: int, sfa: dict, checked: Optional[Verdict],
            baselines: dict) -> dict:
    """One result row, with the work of its configuration."""
    backend, reason = bench.backend_used(q, mode)
    dim = q.shape[3]
    work = (decode_work(k.shape[1], k.shape[2], dim, topk) if mode == DECODE
            else prefill_work(mode, q.shape[1], k.shape[2], dim, topk))
    return {**row_fields(mode, q, k, checked), "topk": topk, "sfa_backend": backend, "sfa_backend_reason": reason,
            "sfa": sfa, "baselines": baselines, "speedup": speedups(sfa, baselines), "work": work}


def prefill_rows(bench: Bench, mode: str, q, k, v) -> list[dict]:
    """Rows of one (T, D) in ``mode`` (forward or forward+backward), one per k."""
    c, length, dim = bench.config, q.shape[2], q.shape[3]
    dense = dense_prefill(bench, mode, q, k, v)
    rows = []
    for topk in c.top_ks:
        key = ("sfa", mode, dim, topk)
        attn = functools.partial(bench.sfa_fn, topk=topk)
        if mode == BACKWARD:
            checked = bench.backward_verdict(dim, topk)
            sfa = bench.time_backward(key, length, lambda: forward_backward(attn, q, k, v), checked)
        else:
            rows_checked = sample_rows(length, EARLY_ROWS, c.gate_rows, c.seed)
            sfa, checked = bench.time(key, length, lambda: functools.partial(attn, q, k, v), graphable=True,
                                      gate=lambda out: check_rows(out, q, k, v, topk, rows_checked))
        rows.append(sfa_row(bench, mode, q, k, topk, sfa, checked, dense))
        print(format_row(rows[-1]), flush=True)
    return rows


def filled_cache(k, v, topk: int) -> SFAKeyCache:
    """An :class:`SFAKeyCache` holding exactly k, v [1, Hkv, T, D] (no spare capacity)."""
    cache = SFAKeyCache(1, k.shape[1], k.shape[3], topk=topk, dtype=k.dtype, device=k.device, capacity=k.shape[2])
    cache.append(k, v)
    return cache


def decode_rows(bench: Bench, cache_len: int, head_dim: int) -> list[dict]:
    """One-token decode over a cache of ``cache_len``: SFA per k against dense SDPA decode."""
    q, k, v, dense = decode_inputs(bench, cache_len, head_dim)
    rows = []
    for topk in bench.config.top_ks:
        # The cache is filled while the call is made, untimed: a decoder appends each token once, when it comes.
        sfa, checked = bench.time(
            ("sfa", DECODE, head_dim, topk), cache_len,
            lambda: functools.partial(bench.decode_fn, q, filled_cache(k, v, topk)), power=1, graphable=True,
            gate=lambda result: check_rows(result[0], q, k, v, topk, torch.tensor([0])))
        rows.append(sfa_row(bench, DECODE, q, k, topk, sfa, checked, {"sdpa": dense}))
        print(format_row(rows[-1]), flush=True)
    return rows


def run(config: BenchConfig, on_rows: Optional[Callable[[list], object]] = None) -> list[dict]:
    """Every row of the benchmark, printed as it completes (and handed to ``on_rows``, :func:`.common.sweep`)."""
    return sweep(Bench(config), TABLE_HEADER, prefill_rows, decode_rows, on_rows)


# ---------------------------------------------------------------------------------------------------- reporting

TABLE_HEADER = table_header(["mode", "T", "D", "k", "sfa ms", "cuDNN ms", "x cuDNN", "x cuda-core", "peak GB",
                             "correct"])


def format_row(row: dict) -> str:
    """One markdown table line. Decode rows show dense SDPA (its backend named when not cuDNN) under cuDNN."""
    return markdown_row([row["mode"], format_length(row["T"]), row["head_dim"], row["topk"], number(row["sfa"]["ms"]),
                         *dense_cells(row), number(row["speedup"].get("cuda-core"), 2, "x"),
                         number(row["sfa"]["peak_gb"], 2), gate_cell(row["correct"])])


def plot_speedups(rows: list[dict], path: Path) -> Path:
    """PNG of SFA's speedup against T (log x), one panel per mode, one colour per (D, k): solid over dense cuDNN
    (decode: dense SDPA decode), dashed over the CUDA-core dense kernel."""
    return plot_modes(rows, path, _plot_mode)


def _plot_mode(ax, rows: list[dict], mode: str) -> None:
    series = sorted({(r["head_dim"], r["topk"]) for r in rows})
    for index, (dim, topk) in enumerate(series):
        mine = [r for r in rows if (r["head_dim"], r["topk"]) == (dim, topk)]
        color, label = f"C{index % 10}", f"D={dim} k={topk}"
        plot_ratio(ax, mine, lambda r: r["speedup"].get(dense_baseline(r)), marker="o", color=color,
                   label=f"{label} vs {dense_labels(mine)}")
        plot_ratio(ax, mine, lambda r: r["speedup"].get("cuda-core"), marker="s", linestyle="--", color=color,
                   label=f"{label} vs CUDA-core")
    speedup_axis(ax, rows, mode, "speedup of SFA", f"SFA {mode}")


def main(args: argparse.Namespace) -> int:
    """Runs ``sieve bench sfa``; writes OUT/bench_sfa.json and OUT/sfa_speedup_vs_length.png."""
    config = config_from_args(args)
    record = Record(config, args.out, "bench_sfa.json", kv_cache=cache_bytes(config.head_dims, config.top_ks))
    return finish(record, run(config, on_rows=record.write), plot_speedups, "sfa_speedup_vs_length.png",
                  method="sfa")
