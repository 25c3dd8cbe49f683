"""SFACache: transformers generation over SFA's compressed key cache (codes per key, dense V).

References: recomputing the whole sequence at every step (no cache), transformers' own dense cache through the same
composed model, and the composed model in float64 (for the FlashAttention error rule).
"""
from __future__ import annotations

import pytest
import torch

import sieve_attn as sa
import sieve_attn.nn.sfa_layer as sfa_layer
from sieve_attn.eval.generate import cache_keyword, greedy_recompute
from sieve_attn.integrations.sfa_cache import SFACacheLayer
from sieve_attn.integrations.transformers import sfa_layers
from sieve_attn.ops.sfa.cache import packed_bytes

try:
    from tests.integrations.test_transformers import _left_padded, _logits
    from tests.models import random_ids, skip_without_cpu_kernels, threads, tiny_model
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from integrations.test_transformers import _left_padded, _logits
    from models import random_ids, skip_without_cpu_kernels, threads, tiny_model

TOPK, PROMPT, NEW, LAYERS = 4, 20, 8, 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with threads(1):
        yield


@pytest.fixture
def decode_calls(monkeypatch) -> list:
    """Records every sfa_decode call the SFA layers make (one per layer and decode step on the fast path)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    real = sfa_layer.sfa_decode
    monkeypatch.setattr(sfa_layer, "sfa_decode", spy)
    return calls


def _cache_argument(model, cache) -> dict:
    return {cache_keyword(model): cache}


def _generate(model, ids, cache=None, **kwargs):
    kwargs = {**dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, output_logits=True,
                     return_dict_in_generate=True), **kwargs}
    if cache is not None:
        kwargs.update(_cache_argument(model, cache))
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def _step_logits(out) -> torch.Tensor:
    return torch.stack(out.logits, dim=1)  # [B, new, V]: the logits each decoding step produced


@pytest.mark.parametrize("arch, backend", [("llama", "reference"), ("qwen2", "reference"), ("llama", "triton"),
                                           ("llama", "sdpa")])
def test_generation_reads_the_codes_and_equals_recomputation(arch, backend, decode_calls):
    """Every decode step of every layer reads the cached codes through sfa_decode (Triton's decode kernel for
    backend 'triton', through the interpreter on the CPU; 'sdpa' prefills through dense SDPA and decodes as 'auto');
    the greedy tokens equal recomputing the whole sequence
    at each step and the dense-cache path's; the logits obey FlashAttention's rule: their error against the model
    run in float64 is at most twice the dense-cache path's, plus a floor. The cache holds codes, not dense keys."""
    if backend == "triton":
        skip_without_cpu_kernels()
    model = sa.compose(tiny_model(arch), sa.SFAConfig(topk=TOPK, backend=backend))
    reference = sa.compose(tiny_model(arch), sa.SFAConfig(topk=TOPK, backend="reference"))  # PyTorch's own path
    prompt = random_ids(2, PROMPT, seed=7)
    cache = sa.SFACache(model)
    compressed = _generate(model, prompt, cache)
    assert len(decode_calls) == (NEW - 1) * LAYERS and all(shape[2] == 1 for shape in decode_calls)
    dense = _generate(reference, prompt)
    assert torch.equal(compressed.sequences, dense.sequences)
    assert torch.equal(compressed.sequences, greedy_recompute(reference, prompt, NEW))

    exact = _logits(sa.compose(tiny_model(arch).double(), sa.SFAConfig(topk=TOPK)), compressed.sequences[:, :-1])
    exact = exact[:, PROMPT - 1:]

    def error(out) -> float:
        return (_step_logits(out).double() - exact).abs().max().item()

    assert error(compressed) <= 2 * error(dense) + 1e-6

    assert cache.get_seq_length() == PROMPT + NEW - 1
    for layer in cache.layers:
        assert layer.keys is None and layer.values is None  # transformers' dense tensors are never filled
        assert len(layer.store) == PROMPT + NEW - 1 and layer.store.topk == TOPK


def test_cache_memory_is_the_compressed_one():
    """Measured bytes per token and KV head: the SFAKeyCache's (topk values, topk indices of at most a byte each,
    dense V) against transformers' DynamicCache after the same prompt (dense K and V)."""
    from transformers import DynamicCache

    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK))
    ids = random_ids(2, PROMPT)
    cache, dense = sa.SFACache(model, capacity=PROMPT), DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **_cache_argument(model, cache))
        model(ids, **_cache_argument(model, dense))
    head_dim, itemsize, kv_heads = 16, 4, 2
    dense_per_token = sum(layer.keys.nbytes + layer.values.nbytes for layer in dense.layers) / (2 * kv_heads * PROMPT)
    assert dense_per_token == LAYERS * sa.dense_bytes_per_token(head_dim, torch.float32) == LAYERS * 128
    per_token = [layer.store.bytes_per_token() for layer in cache.layers]
    # bit-packed indices (4 x 4 bits at D=16), 4 key values and V in float32: 82 of 128 bytes
    assert all(bytes_ == packed_bytes(TOPK, head_dim) + (TOPK + head_dim) * itemsize for bytes_ in per_token)
    assert cache.allocated_bytes() == sum(per_token) * 2 * kv_heads * PROMPT  # capacity = the prompt: no slack


@pytest.mark.parametrize("case, fast_steps", [
    ("gpt2", True), ("olmo2", True), ("qwen3", True), ("beam search", True),
    ("left padding", False), ("gemma2", False), ("mistral", False), ("focus+sfa", False),
])
def test_every_path_equals_the_dense_cache(case, fast_steps, decode_calls):
    """The other architectures, beam search (reorder_cache), a left-padded batch (a mask at every step), Gemma-2
    (softcap; its local layers and all of Mistral's slide a window of 8 past a 20-token prompt, so the cache drops
    old codes) and Focus + SFA: same tokens and logits as transformers' dense cache. ``fast_steps``: the decode
    steps read the codes through sfa_decode; otherwise they densify the layer's codes for the step."""
    arch = case if case in ("gpt2", "olmo2", "qwen3", "gemma2", "mistral") else "llama"
    torch.manual_seed(0)
    focus = [sa.FocusConfig(num_groups=4, window=4, top_k=1)] if case == "focus+sfa" else []
    model = sa.compose(tiny_model(arch), *focus, sa.SFAConfig(topk=TOPK))
    ids, kwargs = random_ids(2, PROMPT, seed=7), {}
    if case == "left padding":
        ids, kwargs["attention_mask"], _, _ = _left_padded(random_ids(1, PROMPT, seed=3), random_ids(1, 14, seed=4))
    if case == "beam search":
        kwargs = dict(num_beams=3, output_logits=False)
    cache = sa.SFACache(model)
    compressed, dense = _generate(model, ids, cache, **kwargs), _generate(model, ids, **kwargs)
    assert torch.equal(compressed.sequences, dense.sequences)
    if case != "beam search":
        torch.testing.assert_close(_step_logits(compressed), _step_logits(dense), rtol=0, atol=1e-5)
    assert len(decode_calls) == ((NEW - 1) * LAYERS if fast_steps else 0)
    windows = [layer.window for layer in cache.layers]
    assert windows == {"gemma2": [8, None], "mistral": [8, 8]}.get(arch, [None, None])
    for layer in cache.layers:
        assert len(layer.store) <= (PROMPT + NEW if layer.window is None else 2 * layer.window - 1)


def test_chunked_prefill_crop_and_batch_selection():
    """A prompt fed in two chunks (the second reads the cached codes under a mask) gives the full forward's logits;
    crop(-n) drops the last n tokens, so feeding them again gives the same logits; batch_select_indices keeps rows."""
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK))
    ids = random_ids(2, PROMPT)
    full = _logits(model, ids)
    cache = sa.SFACache(model)
    with torch.no_grad():
        first = model(ids[:, :12], **_cache_argument(model, cache)).logits
        second = model(ids[:, 12:], **_cache_argument(model, cache)).logits
        torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=0, atol=1e-5)
        cache.crop(-5)
        assert cache.get_seq_length() == PROMPT - 5
        again = model(ids[:, -5:], **_cache_argument(model, cache)).logits
    torch.testing.assert_close(again, full[:, -5:], rtol=0, atol=1e-5)
    indices, values = cache.layers[0].store.keys()
    cache.batch_select_indices(torch.tensor([1, 1, 0]))
    selected = cache.layers[0].store.keys()
    assert torch.equal(selected[0], indices[[1, 1, 0]]) and torch.equal(selected[1], values[[1, 1, 0]])
    for bad in (3, -1.0, torch.tensor(True)):
        with pytest.raises(ValueError, match=r"tokens_to_remove: expected an int in \[-20, 0\]"):
            cache.crop(bad)
    cache.crop(torch.tensor(-1))  # some transformers versions count the rejected drafts in a tensor
    assert cache.get_seq_length() == PROMPT - 1


@pytest.mark.parametrize("configs", [[sa.SFAConfig(topk=TOPK)],
                                     [sa.FocusConfig(num_groups=4, window=4, top_k=1), sa.SFAConfig(topk=TOPK)]],
                         ids=["sfa", "focus + sfa"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_prompt_lookup_generation_crops_the_codes_and_equals_recomputation(arch, configs, monkeypatch):
    """Assisted generation (prompt lookup) feeds draft tokens, then crops the rejected ones from the cache: the
    tokens are those of recomputing the whole sequence at every step, and rejected drafts were cropped. Mistral's
    and Gemma-2's sliding-window layers (window 8, prompt 30) record the past while it runs, so a crop can take back
    drafts past the window (they failed mid-way, or up front, before)."""
    model = sa.compose(tiny_model(arch), *configs)
    crops = []
    real_crop = SFACacheLayer.crop
    monkeypatch.setattr(SFACacheLayer, "crop", lambda layer, n: (crops.append(n), real_crop(layer, n))[1])
    part = random_ids(1, 10, seed=2)
    prompt = torch.cat([part, part, part], dim=1)  # repeats, so prompt lookup finds drafts
    cache = sa.SFACache(model)
    out = _generate(model, prompt, cache, max_new_tokens=16, prompt_lookup_num_tokens=4,
                    output_logits=False, return_dict_in_generate=False)
    assert torch.equal(out, greedy_recompute(model, prompt, 16))
    assert any(n < 0 for n in crops)
    sliding = [layer for layer in cache.layers if layer.window is not None]
    assert all(layer.record_past and len(layer.store) < 2 * layer.window for layer in sliding)  # bounded by crops
    cache.reset()
    assert not any(layer.record_past for layer in cache.layers)  # a reused cache drops old tokens again


def test_sliding_layers_stay_croppable_until_they_drop_tokens():
    """A sliding-window layer (Mistral's window 8) can take tokens back until it drops old ones; after that
    assisted generation is refused up front (transformers asks is_croppable) rather than mid-way."""
    model = sa.compose(tiny_model("mistral"), sa.SFAConfig(topk=TOPK))
    cache = sa.SFACache(model)
    with torch.no_grad():
        model(random_ids(1, 6), **_cache_argument(model, cache))
        assert cache.is_croppable
        model(random_ids(1, 12), **_cache_argument(model, cache))
    assert not cache.is_croppable
    with pytest.raises(ValueError, match=r"tokens_to_remove: expected 0 \(tokens to drop from the end; this "
                                         r"sliding-window layer dropped its oldest tokens and keeps the 7 that the "
                                         r"next query sees\), got -5"):
        cache.crop(-5)


def test_a_deep_copy_reuses_a_prompt_cache():
    """transformers' prompt reuse: copy.deepcopy of a filled cache, then different continuations from each copy;
    both give the full forward's logits (the copy still belongs to the model's SFA layers, feature maps and all),
    and extending one copy leaves the other as it was."""
    import copy

    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK, feature_map=True))
    for layer in sfa_layers(model):
        with torch.no_grad():
            layer.feature_map.copy_(torch.linalg.qr(torch.randn_like(layer.feature_map)).Q)
    prompt, tails = random_ids(2, 12), [random_ids(2, 4, seed=seed) for seed in (3, 4)]
    cache = sa.SFACache(model)
    with torch.no_grad():
        model(prompt, **_cache_argument(model, cache))
        for tail in tails:
            copied = copy.deepcopy(cache)
            assert copied.layers[0].sfa is cache.layers[0].sfa and copied.layers[0].store is not cache.layers[0].store
            out = model(tail, **_cache_argument(model, copied)).logits
            torch.testing.assert_close(out, _logits(model, torch.cat([prompt, tail], 1))[:, 12:], rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 12


def _use(model, cache):
    with torch.no_grad():
        model(random_ids(2, 6), **_cache_argument(model, cache))


def test_misuse_is_refused():
    llama = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK))
    with pytest.raises(ValueError, match="model: expected a model composed with an SFAConfig"):
        sa.SFACache(tiny_model("llama"))
    with pytest.raises(ValueError, match="model: expected a model composed with an SFAConfig"):
        sa.SFACache(sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4)))
    with pytest.raises(ValueError, match="capacity: expected an int in \\[1"):
        sa.SFACache(llama, capacity=0)
    for other in (sa.SFAConfig(topk=8), sa.SFAConfig(topk=TOPK)):  # another model, even of the same config
        with pytest.raises(ValueError, match="past_key_values: expected an SFACache built for this model "
                                             "\\(SFACache\\(model\\)\\), got one built for the SFA layers of "
                                             "another model"):
            _use(llama, sa.SFACache(sa.compose(tiny_model("llama"), other)))
    gpt2 = sa.compose(tiny_model("gpt2"), sa.SFAConfig(topk=TOPK))  # 4 KV heads, against Llama's 2
    with pytest.raises(ValueError, match="past_key_values: expected an SFACache built for this model, got one built "
                                         "for 4 KV heads of dim 16, given keys of shape \\(2, 2, 6, 16\\)"):
        _use(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK)), sa.SFACache(gpt2))
    deeper = sa.compose(tiny_model("llama", num_hidden_layers=3), sa.SFAConfig(topk=TOPK))
    with pytest.raises(ValueError, match="past_key_values: expected an SFACache built for this model"):
        _use(deeper, sa.SFACache(llama))
    with pytest.raises(ValueError, match="past_key_values: expected an SFACache built for this model, got one built "
                                         "for 2 attention layers, given layer 2"):
        sa.SFACache(llama).update(torch.zeros(2, 2, 6, 16), torch.zeros(2, 2, 6, 16), 2)
    for layer in sfa_layers(llama):
        layer.matching = True
    with pytest.raises(ValueError, match="past_key_values: expected no SFACache while the output-matching term"):
        llama(random_ids(2, 6), **_cache_argument(llama, sa.SFACache(llama)))
    cache = sa.SFACache(llama)
    llama.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="model: expected the attention implementation 'sieve_focus'"):
        sa.SFACache(llama)
    with pytest.raises(AttributeError, match="keys held by a sieve_attn.SFACache have no attribute 'shape'"):
        _use(llama, cache)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_generation_under_bf16_autocast_scores_what_a_full_forward_scores(arch):
    """Under autocast a RoPE model's keys reach the cache in float32 beside bfloat16 values: the cache stores both
    in the autocast dtype, as the attention function computes, and each step's logits are the full forward's over
    the same tokens to bfloat16 rounding (on average within 5% of their mean magnitude)."""
    model = sa.compose(tiny_model(arch), sa.SFAConfig(topk=TOPK))
    prompt = random_ids(2, PROMPT)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             **{cache_keyword(model): sa.SFACache(model)})
        full = model(out.sequences[:, :-1]).logits[:, PROMPT - 1:]
    steps = torch.stack(out.logits, dim=1).float()
    assert (steps - full.float()).abs().mean() < 0.05 * full.float().abs().mean()
