"""Configuration of the sparse-attention methods a model can be composed with."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ._checks import check_choice, check_int, check_positive_float, check_real, fail

FOCUS_MODES = ("train", "soft", "hard", "dense")
FOCUS_BACKENDS = ("auto", "reference", "dense", "triton")
# Settings that change how a trained router is used, not what it is: an adapter fits whatever their values. top_k
# is read by hard routing alone, never in training (mode "train" routes softly).
FOCUS_INFERENCE_FIELDS = ("mode", "backend", "top_k")
# Likewise for SFA: which kernels compute the scores.
SFA_INFERENCE_FIELDS = ("backend",)


def _store(config, name: str, value) -> None:
    """Sets a field of a frozen config to its checked value (numpy numbers become Python ones, so that the config
    compares, hashes and writes to JSON as one built from Python numbers)."""
    object.__setattr__(config, name, value)


class _Serialisable:
    """to_dict / from_dict of a config dataclass (JSON of adapters and results)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            fail(cls.__name__, f"fields among {sorted(cls.__dataclass_fields__)}", f"unknown {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class FocusConfig(_Serialisable):
    """Focus router and pattern settings (defaults: the paper's Appendix B, and our measured choices).

    num_groups: K centroids per layer. group_dim: d_g, the router's projection width. window: w, local pairs
    0 <= i - j <= w always attend. top_k: groups each token keeps at inference. tau: temperature of the router
    logits (applied once). sinkhorn_iters: Sinkhorn iterations in training. gate: soft gate used in training,
    "log" or "multiplicative" (docs/decisions.md, decision 2). gate_lambda: lambda of the multiplicative gate.
    sink_tokens: the first tokens of every sequence join every group (pretrained models park attention there); in a
    left-padded batch, each row's first real tokens; in a row of packed sequences (position ids that restart, which
    transformers turns into a block-diagonal mask), each sequence's first tokens.
    bias_momentum: running-average momentum of the causal group biases taken from the Sinkhorn potentials.
    train_routing: memberships the soft gate uses in mode "train": "sinkhorn" (the paper; sees the whole sequence,
    with packing the whole row) or "causal" (the inference routing, softmax of logits + group biases; strictly causal).
    mode: what the composed attention computes: "train" (Sinkhorn + soft gate, sees the whole sequence),
    "soft" (causal routing + soft gate), "hard" (causal top-k groups, the sparse pattern), "dense" (router off).
    backend: how the hard pattern is computed, one of :func:`sieve_attn.focus_attention`'s backends that serve
    prefill and decode alike: "auto" (the fastest exact one for the device and length, the op's "sdpa"
    decomposition included where it wins), "reference", "dense" or "triton". The op's "sdpa" and "flex" backends
    compute prefill only (Tq == Tk), so a model cannot be pinned to them.
    """

    num_groups: int = 8
    group_dim: int = 16
    window: int = 128
    top_k: int = 2
    tau: float = 0.1
    sinkhorn_iters: int = 10
    gate: str = "log"
    gate_lambda: float = 10.0
    sink_tokens: int = 1
    bias_momentum: float = 0.95
    train_routing: str = "sinkhorn"
    mode: str = "hard"
    backend: str = "auto"

    def __post_init__(self):
        _store(self, "num_groups", check_int("num_groups", self.num_groups, 1))
        _store(self, "group_dim", check_int("group_dim", self.group_dim, 1))
        _store(self, "window", check_int("window", self.window, 0))
        _store(self, "top_k", check_int("top_k", self.top_k, 1, self.num_groups))
        _store(self, "tau", check_positive_float("tau", self.tau))
        _store(self, "sinkhorn_iters", check_int("sinkhorn_iters", self.sinkhorn_iters, 1))
        check_choice("gate", self.gate, ("log", "multiplicative"))
        _store(self, "gate_lambda", check_positive_float("gate_lambda", self.gate_lambda))
        _store(self, "sink_tokens", check_int("sink_tokens", self.sink_tokens, 0))
        _store(self, "bias_momentum", check_real("bias_momentum", self.bias_momentum, lambda x: 0 <= x < 1,
                                                 "a number in [0, 1)"))
        check_choice("train_routing", self.train_routing, ("sinkhorn", "causal"))
        check_choice("mode", self.mode, FOCUS_MODES)
        check_choice("backend", self.backend, FOCUS_BACKENDS)



SFA_DECODE_BACKENDS = ("auto", "reference", "triton")
SFA_BACKENDS = (*SFA_DECODE_BACKENDS, "sdpa")
SFA_SELECTIONS = ("magnitude", "importance")


def sfa_decode_backend(backend: str) -> str:
    """The :func:`sieve_attn.sfa_decode` backend for an SFA ``backend``: a decode step reads a compressed cache's
    codes, so "sdpa" (dense attention on dense keys) decodes as "auto"."""
    return "auto" if backend == "sdpa" else backend


@dataclass(frozen=True)
class SFAConfig(_Serialisable):
    """Sparse Feature Attention settings (arXiv 2603.22300; docs/decisions.md, decisions 8-12).

    topk: coordinates of q and k kept per token and head, by largest |x| after RoPE (q per query head, k per KV
    head); it must not exceed the model's head dim, which :func:`sieve_attn.compose` checks. What a converted model
    loses depends on topk's share of the head dim: SmolLM2-135M (head dim 64) fine-tuned to SFA ends 1.11x the
    dense fine-tune's held-out perplexity at 16, 1.05x at 20, 1.02x at 24 (docs/results.md). feature_map: whether
    each layer maps q and k, after RoPE and before the top-k, by a learned matrix [D, D] per KV head (the same one
    for the KV head's keys and its query heads' queries), our reading of the paper for RoPE models
    (docs/decisions.md, decision 9): a basis in which q and k concentrate on fewer coordinates, so the top-k keeps
    more of each score.
    compose starts it at the identity, :func:`sieve_attn.calibrate_feature_maps` sets it to the principal axes of
    the layer's dense q and k (an orthogonal map, so dense scores are unchanged), and fine-tuning trains it; it
    lives in the adapter. selection: how each vector's top-k is chosen, after the map: "magnitude" (the paper:
    largest |x|) or "importance" (largest |x_u| * w_u; each layer holds weights [Hkv, D] for its queries, the
    keys' root mean square along each coordinate, and for its keys, the queries' one, so a coordinate ranks by the
    share of a typical score it carries; all 1 until :func:`sieve_attn.calibrate_feature_maps` sets them from data;
    kept fixed by fine-tuning, saved in the adapter). backend: how the SFA scores are computed
    (:func:`sieve_attn.sfa_attention`'s ``backend``); decode steps over an :class:`~sieve_attn.SFACache` read its
    codes with :func:`sieve_attn.sfa_decode`, which takes "auto" for "sdpa" (there are no dense keys to give dense
    attention); with Focus as well, the Focus pattern's backend computes them on the sparsified q and k.
    """

    topk: int = 16
    backend: str = "auto"
    feature_map: bool = False
    selection: str = "magnitude"

    def __post_init__(self):
        _store(self, "topk", check_int("topk", self.topk, 1))
        if not isinstance(self.feature_map, bool):
            fail("feature_map", "True or False", repr(self.feature_map))
        check_choice("backend", self.backend, SFA_BACKENDS)
        check_choice("selection", self.selection, SFA_SELECTIONS)
