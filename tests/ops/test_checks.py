"""Bad inputs raise ValueError naming the offending argument (or config field), before any computation."""
from __future__ import annotations

import re

import pytest
import torch

from sieve_attn import FocusConfig, focus_attention, focus_backend, focus_soft_attention

B, HQ, HKV, T, D = 2, 4, 2, 11, 8


def qkv(hq=HQ, hkv=HKV, tq=T, tk=T, d=D, dtype=torch.float32, batch=B):
    torch.manual_seed(0)
    return (torch.randn(batch, hq, tq, d, dtype=dtype), torch.randn(batch, hkv, tk, d, dtype=dtype),
            torch.randn(batch, hkv, tk, d, dtype=dtype))


def groups2d(length=T):
    return torch.arange(length).remainder(3).expand(B, length).contiguous()


def groups3d(length=T):
    g = torch.stack([torch.arange(length).remainder(3), torch.full((length,), -1)], dim=-1)
    return g.expand(B, length, 2).contiguous()


def assign(length=T, k=3):
    return torch.softmax(torch.randn(B, length, k), dim=-1)


def hard(**overrides):
    """focus_attention on valid inputs, with some replaced."""
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, groups=groups2d())
    args.update({name: overrides.pop(name) for name in list(overrides) if name in args})
    return lambda: focus_attention(args["q"], args["k"], args["v"], args["groups"], **overrides)


def soft(**overrides):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, assign=assign())
    args.update({name: overrides.pop(name) for name in list(overrides) if name in args})
    return lambda: focus_soft_attention(args["q"], args["k"], args["v"], args["assign"], **overrides)


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


q0, k0, v0 = qkv()
BAD_CALLS = {
    # name of the case: (call, argument names any one of which the message must name)
    "q not 4-d": (hard(q=q0[0]), ("q",)),
    "k dtype differs": (hard(k=k0.double()), ("k",)),
    "v dtype differs": (hard(v=v0.half()), ("v",)),
    "Hq % Hkv != 0": (lambda: focus_attention(*qkv(hq=6, hkv=4), groups2d()), ("k", "q")),
    "head dim mismatch": (lambda: focus_attention(qkv(d=16)[0], k0, v0, groups2d()), ("k", "q")),
    "batch mismatch": (lambda: focus_attention(qkv(batch=1)[0], k0, v0, groups2d()[:1]), ("k", "q")),
    "Tq > Tk": (lambda: focus_attention(qkv(tq=T + 1)[0], k0, v0, groups2d()), ("q", "k")),
    "v shape differs from k": (hard(v=v0[:, :, :-1]), ("v",)),
    "groups float": (hard(groups=groups2d().float()), ("groups",)),
    "groups bool": (hard(groups=groups2d() > 0), ("groups",)),
    "groups wrong length": (hard(groups=groups2d(T - 1)), ("groups",)),
    "groups wrong batch": (hard(groups=groups2d()[:1]), ("groups",)),
    "groups m = 0": (hard(groups=torch.zeros(B, T, 0, dtype=torch.long)), ("groups",)),
    "groups a list": (hard(groups=[[0] * T] * B), ("groups",)),
    "groups 4-d": (hard(groups=groups3d()[..., None]), ("groups",)),
    "groups -2": (hard(groups=_with(groups3d(), (0, 3, 1), -2)), ("groups",)),
    "groups token all -1": (hard(groups=_with(groups3d(), (1, 4), -1)), ("groups",)),
    "groups same id twice": (hard(groups=_with(groups3d(), (0, 5, 1), 2)), ("groups",)),  # token 5 is in group 2
    "2-d groups with -1": (hard(groups=_with(groups2d(), (0, 2), -1)), ("groups",)),
    "window negative": (hard(window=-1), ("window",)),
    "window float": (hard(window=2.5), ("window",)),
    "window bool": (hard(window=True), ("window",)),
    "backend unknown": (hard(backend="nope"), ("backend",)),
    "scale zero": (hard(scale=0.0), ("scale",)),
    "scale negative": (hard(scale=-0.5), ("scale",)),
    "scale nan": (hard(scale=float("nan")), ("scale",)),
    "scale a bool": (hard(scale=True), ("scale",)),
    "softcap zero": (hard(softcap=0.0), ("softcap",)),
    "softcap negative": (hard(softcap=-3.0), ("softcap",)),
    "NaN in q": (hard(q=_with(q0, (1, 2, 3, 4), float("nan"))), ("q",)),
    "NaN in v": (hard(v=_with(v0, (0, 1, 2, 3), float("nan"))), ("v",)),
    "inf in k": (hard(k=_with(k0, (0, 1, 2, 3), float("inf"))), ("k",)),
    "head dim 0": (lambda: focus_attention(*qkv(d=0), groups2d()), ("q",)),
    "causal a string": (hard(causal="no"), ("causal",)),
    "causal None": (hard(causal=None), ("causal",)),
    "causal a 1-element bool tensor": (hard(causal=torch.tensor([True])), ("causal",)),
    "attn_mask on another device": (hard(attn_mask=torch.ones(B, 1, T, T, dtype=torch.bool, device="meta")),
                                    ("attn_mask",)),
    "soft: causal an int": (soft(causal=1), ("causal",)),
    "attn_mask float": (hard(attn_mask=torch.ones(B, 1, T, T)), ("attn_mask",)),
    "attn_mask wrong shape": (hard(attn_mask=torch.ones(B, 1, T, T - 1, dtype=torch.bool)), ("attn_mask",)),
    "attn_mask wrong heads": (hard(attn_mask=torch.ones(B, 3, T, T, dtype=torch.bool)), ("attn_mask",)),
    "attn_mask 3-d": (hard(attn_mask=torch.ones(B, T, T, dtype=torch.bool)), ("attn_mask",)),
    "out wrong shape": (hard(out=torch.empty(B, HQ, T, D + 1)), ("out",)),
    "out wrong dtype": (hard(out=torch.empty(B, HQ, T, D, dtype=torch.float64)), ("out",)),
    "out not contiguous": (hard(out=torch.empty(B, HQ, D, T).transpose(-1, -2)), ("out",)),
    "soft: q not 4-d": (soft(q=q0[0]), ("q",)),
    "soft: assign negative": (soft(assign=_with(assign(), (0, 1, 2), -0.1)), ("assign",)),
    "soft: assign wrong shape": (soft(assign=assign(T - 1)), ("assign",)),
    "soft: assign 2-d": (soft(assign=assign()[0]), ("assign",)),
    "soft: assign K = 0": (soft(assign=torch.ones(B, T, 0)), ("assign",)),
    "soft: assign int": (soft(assign=torch.ones(B, T, 3, dtype=torch.long)), ("assign",)),
    "soft: assign inf": (soft(assign=_with(assign(), (0, 1, 2), float("inf"))), ("assign",)),
    "soft: assign on another device": (soft(assign=assign().to("meta")), ("assign",)),
    "return_lse a string": (hard(return_lse="no"), ("return_lse",)),
    "backend of: return_lse a string": (lambda: focus_backend(q0, k0, groups2d(), return_lse="no"), ("return_lse",)),
    "soft: return_lse a string": (soft(return_lse="no"), ("return_lse",)),
    "soft: gate unknown": (soft(gate="bogus"), ("gate",)),
    "soft: window negative": (soft(window=-2), ("window",)),
    "soft: gate_lambda zero": (soft(gate_lambda=0.0), ("gate_lambda",)),
    "soft: softcap negative": (soft(softcap=-1.0), ("softcap",)),
    "soft: scale negative": (soft(scale=-1.0), ("scale",)),
    "soft: attn_mask float": (soft(attn_mask=torch.ones(B, 1, T, T)), ("attn_mask",)),
    "soft: attn_mask wrong shape": (soft(attn_mask=torch.ones(B, 1, T - 1, T, dtype=torch.bool)), ("attn_mask",)),
}


def names_argument(message: str, names) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) for name in names)


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_value_error_naming_it(case):
    call, names = BAD_CALLS[case]
    with pytest.raises(ValueError) as info:
        call()
    assert names_argument(str(info.value), names), f"{case}: message {str(info.value)!r} names none of {names}"


GOOD_CALLS = {
    "defaults": hard(),
    "groups int32 [B,T,m] with -1": hard(groups=groups3d().int()),
    "window 0": hard(window=0),
    "MQA": lambda: focus_attention(*qkv(hq=4, hkv=1), groups2d()),
    "decode Tq=1": lambda: focus_attention(qkv(tq=1)[0], k0, v0, groups2d()),
    "attn_mask [1,Hq,Tq,Tk]": hard(attn_mask=torch.ones(1, HQ, T, T, dtype=torch.bool)),
    "out given": hard(out=torch.empty(B, HQ, T, D)),
    "scale and softcap": hard(scale=0.1, softcap=30.0, backend="reference"),
    "soft defaults": soft(),
    "soft multiplicative": soft(gate="multiplicative", gate_lambda=3),
    "soft sink row of ones": soft(assign=_with(assign(), (slice(None), 0), 1.0)),
    "soft one token": lambda: focus_soft_attention(*qkv(tq=1, tk=1), assign(1)),
    "causal a numpy bool": hard(causal=__import__("numpy").False_),
    "causal a 0-d bool tensor": hard(causal=torch.tensor(True)),
}


@pytest.mark.parametrize("case", list(GOOD_CALLS))
def test_good_inputs_do_not_raise(case):
    out = GOOD_CALLS[case]()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("field,value", [
    ("num_groups", 0), ("top_k", 0), ("top_k", 9), ("tau", 0), ("tau", -0.1), ("sinkhorn_iters", 0), ("gate", "x"),
    ("sink_tokens", -1), ("bias_momentum", 1.0), ("bias_momentum", -0.1), ("mode", "x"), ("window", -1),
    ("group_dim", 0), ("gate_lambda", 0.0), ("num_groups", 2.0), ("top_k", True), ("tau", True),
])
def test_focus_config_validation(field, value):
    with pytest.raises(ValueError) as info:
        FocusConfig(**{field: value})
    assert names_argument(str(info.value), (field,)), str(info.value)


def test_focus_config_accepts_valid_and_round_trips():
    config = FocusConfig(num_groups=4, top_k=4, tau=0.5, sinkhorn_iters=1, gate="multiplicative", sink_tokens=0,
                         bias_momentum=0.0, mode="train", window=0)
    assert FocusConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="FocusConfig"):
        FocusConfig.from_dict({**config.to_dict(), "bogus": 1})


def test_configs_and_calls_take_numpy_numbers_as_python_ones():
    """Numpy integers and floats (a sweep over np.arange) are taken where an int or a number is asked, and stored as
    Python numbers: the config equals, hashes and writes to JSON as the one built from Python numbers; numpy's
    bools are still refused where an int is asked."""
    import json

    import numpy as np

    from sieve_attn import SFAConfig
    from sieve_attn.train.finetune import FinetuneSettings

    config = FocusConfig(num_groups=np.int64(4), top_k=np.int32(2), tau=np.float32(0.5), window=np.uint8(3),
                         bias_momentum=np.float64(0.5))
    plain = FocusConfig(num_groups=4, top_k=2, tau=0.5, window=3, bias_momentum=0.5)
    assert config == plain and hash(config) == hash(plain)
    assert json.dumps(config.to_dict()) == json.dumps(plain.to_dict())
    assert type(SFAConfig(topk=np.int16(8)).topk) is int
    settings = FinetuneSettings(steps=np.int64(3), lr=np.float32(0.25), matching_weight=np.float64(2))
    settings.check()
    assert json.dumps(vars(settings)) == json.dumps(vars(FinetuneSettings(steps=3, lr=0.25, matching_weight=2.0)))
    q, k, v = qkv()
    out = focus_attention(q, k, v, groups2d(), window=np.int64(2), backend="reference")
    assert torch.equal(out, focus_attention(q, k, v, groups2d(), window=2, backend="reference"))
    with pytest.raises(ValueError, match=r"^num_groups: expected an int in \[1, inf\], got np.True_"):
        FocusConfig(num_groups=np.True_)


def test_a_non_contiguous_out_is_named_so():
    with pytest.raises(ValueError, match=r"^out: expected a contiguous .*, got a non-contiguous torch.float32"):
        BAD_CALLS["out not contiguous"][0]()
