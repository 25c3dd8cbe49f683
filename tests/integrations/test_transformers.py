"""Focus composed into transformers models: every architecture of DESIGN.md on tiny random configs.

The reference for every equivalence is an independent uncomposed copy of the same weights running transformers'
own eager attention (``tests.models.eager_copy``), never the package's code path.
"""
from __future__ import annotations

import copy as copy_module
import io
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file

import sieve_attn as sa
from sieve_attn.eval.generate import cache_keyword, greedy_recompute
from sieve_attn.integrations.transformers import attention_modules, focus_layers
from sieve_attn.nn.focus_layer import FocusLayer
from sieve_attn.nn.router import FocusRouter

try:
    from tests.models import (ARCHS, SEQ, SLIDING, VOCAB, eager_copy, random_ids, skip_without_cpu_kernels, threads,
                              tiny_model)
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import ARCHS, SEQ, SLIDING, VOCAB, eager_copy, random_ids, skip_without_cpu_kernels, threads, tiny_model

MODES = ("train", "soft", "hard", "dense")
SPARSE = dict(num_groups=4, window=4, top_k=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with threads(1):
        yield


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, use_cache=False, **kwargs).logits


def _router_param_names(model) -> set[str]:
    """Names (as in named_parameters) of the parameters that live inside a FocusRouter module."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, FocusRouter):
            names |= {f"{prefix}.{name}" for name, _ in module.named_parameters()}
    return names


def _pair_fraction(model, ids, **kwargs) -> tuple[int, int]:
    """(attended, candidate) causal pairs of the hard pattern summed over layers, from the layers' own counters."""
    layers = list(focus_layers(model))
    for layer in layers:
        layer.count_pairs, layer.pair_counts = True, [0, 0]
    try:
        _logits(model, ids, **kwargs)
    finally:
        for layer in layers:
            layer.count_pairs = False
    return sum(layer.pair_counts[0] for layer in layers), sum(layer.pair_counts[1] for layer in layers)


def _local_pairs(batch: int, length: int, window: int) -> int:
    """Causal pairs with 0 <= i - j <= window, counted by hand."""
    return batch * sum(min(i, window) + 1 for i in range(length))


# 1. Every architecture composes; every mode runs forward; training reaches the routers only; generate works.

@pytest.mark.parametrize("arch", ARCHS)
def test_compose_modes_backward_generate(arch):
    model = tiny_model(arch)
    original = {name for name, _ in model.named_parameters()}
    ids = random_ids()
    dense_before = _logits(eager_copy(model), ids)  # eager: transformers 5.17's SDPA path drops Gemma-2's softcap
    torch.manual_seed(0)
    assert sa.compose(model, sa.FocusConfig(**SPARSE)) is model

    layers = list(focus_layers(model))
    assert len(layers) == model.config.get_text_config().num_hidden_layers
    assert all(isinstance(getattr(m, "sieve_focus"), FocusLayer) for _, m in attention_modules(model))
    assert model.config._attn_implementation == "sieve_focus"

    outputs = {}
    for mode in MODES:
        sa.set_focus_mode(model, mode)
        assert all(layer.config.mode == mode for layer in layers)
        assert model.sieve_config.mode == mode
        outputs[mode] = _logits(model, ids)
        assert outputs[mode].shape == (2, SEQ, model.config.vocab_size)
        assert torch.isfinite(outputs[mode]).all(), mode
    # the mode switch takes effect: the sparse pattern (window 4 < T, top_k 2 < K) is not dense attention
    assert (outputs["hard"] - outputs["dense"]).abs().max() > 1e-3
    assert (outputs["dense"] - dense_before).abs().max() < 1e-5

    sa.set_focus_mode(model, "train")
    loss = model(ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss)
    loss.backward()
    routers = _router_param_names(model)
    assert len(routers) == 2 * len(layers)  # W_g and the centroids of each layer
    assert {name for name, _ in model.named_parameters()} == original | routers
    for name, param in model.named_parameters():
        if name in routers:
            assert param.requires_grad, name
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert not param.requires_grad, name
            assert param.grad is None, name

    for mode in ("hard", "soft", "dense"):
        sa.set_focus_mode(model, mode)
        with torch.no_grad():
            out = model.generate(ids[:, :10], attention_mask=torch.ones_like(ids[:, :10]), max_new_tokens=6,
                                 do_sample=False)
        assert out.shape == (2, 16)
        assert torch.equal(out[:, :10], ids[:, :10])
        assert int(out.min()) >= 0 and int(out.max()) < model.config.vocab_size


def test_train_mode_cannot_extend_a_kv_cache():
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE, mode="train"))
    with pytest.raises(RuntimeError, match="train"), torch.no_grad():
        model.generate(random_ids(1, 10), max_new_tokens=3, do_sample=False)


# 2. Degenerate patterns give the original model exactly (to float rounding), every architecture.

DEGENERATE = {"top_k=K": dict(num_groups=4, window=4, top_k=4), "window>=T": dict(num_groups=4, window=SEQ, top_k=1),
              "one group": dict(num_groups=1, window=2, top_k=1)}


@pytest.mark.parametrize("pattern", list(DEGENERATE))
@pytest.mark.parametrize("arch", ARCHS)
def test_degenerate_pattern_equals_original(arch, pattern):
    model = tiny_model(arch)
    reference = eager_copy(model)
    ids = random_ids()
    expected = _logits(reference, ids)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(**DEGENERATE[pattern], mode="hard"))
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)
    sa.set_focus_mode(model, "dense")
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_pattern_differs_from_original(arch):
    """The degenerate test above can fail: a truly sparse pattern moves the logits far beyond its tolerance."""
    model = tiny_model(arch)
    expected = _logits(eager_copy(model), random_ids())
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1))
    assert (_logits(model, random_ids()) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("arch, change", [("gemma2", dict(attn_logit_softcapping=None)),
                                          ("gemma2", dict(sliding_window=1000)),
                                          ("mistral", dict(sliding_window=None))])
def test_reference_depends_on_softcap_and_sliding_window(arch, change):
    """The tiny configs are such that losing the softcap or a sliding window changes the logits: so the degenerate
    equivalence above does check that the composed attention keeps them."""
    ids = random_ids()
    base = _logits(tiny_model(arch, attn_implementation="eager"), ids)
    changed = _logits(tiny_model(arch, attn_implementation="eager", **change), ids)
    assert (changed - base).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_sliding_window_bounds_sparse_pattern(mode):
    """Mistral, 2 layers, sliding window 8: position i sees tokens i-14..i only, whatever the groups say (the sink
    token 0 included). Changing token 0 must leave every position >= 15 unchanged."""
    model = tiny_model("mistral")
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=2, top_k=1, sink_tokens=1, mode=mode))
    ids = random_ids(1)
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % 100
    reach = 2 * (SLIDING - 1)
    a, b = _logits(model, ids), _logits(model, other)
    torch.testing.assert_close(a[:, reach + 1:], b[:, reach + 1:], rtol=0, atol=1e-6)
    assert (a[:, :reach + 1] - b[:, :reach + 1]).abs().max() > 1e-3  # the change does reach nearby positions


# 3. Padding.

def _left_padded(long: torch.Tensor, short: torch.Tensor):
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, position_ids, pad


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_matches_unpadded(arch, mode, sinks):
    """The pattern of a sequence depends on relative positions and its own tokens only (its sinks are its own
    first tokens, wherever padding puts them), so left padding (masked, with position ids that skip it) gives
    each real position the logits it has alone."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=sinks, mode=mode))
    long, short = random_ids(1, SEQ, seed=3), random_ids(1, SEQ - 12, seed=4)
    ids, mask, position_ids, pad = _left_padded(long, short)
    batched = _logits(model, ids, attention_mask=mask, position_ids=position_ids)
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched[1, pad:], _logits(model, short)[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(batched[0], _logits(model, long)[0], rtol=0, atol=1e-5)
    if mode == "hard" and not sinks:
        attended, candidates = _pair_fraction(model, short)
        # truly sparse, and the groups matter: more than the window's pairs in each layer (no sinks here)
        assert 2 * _local_pairs(1, short.shape[1], 4) < attended < 0.9 * candidates


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_degenerate_equals_original(arch):
    """The degenerate pattern (every group) equals the original model on a left-padded batch at every real
    position, sinks and all."""
    model = tiny_model(arch)
    reference = eager_copy(model)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=4))
    ids, mask, position_ids, pad = _left_padded(random_ids(1, SEQ, seed=3), random_ids(1, SEQ - 12, seed=4))
    got = _logits(model, ids, attention_mask=mask, position_ids=position_ids)
    expected = _logits(reference, ids, attention_mask=mask, position_ids=position_ids)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, pad:], expected[1, pad:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunks", [(5, 31), (1,) * 36, (9, 1, 26), (8, 1, 1, 26)],
                         ids=["5+31", "token by token", "pads, then the first real token alone", "pad alone"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_left_padded_prompt_fed_in_chunks_scores_as_one_forward(arch, chunks):
    """A cache filled chunk by chunk, a chunk as small as one token, gives each real position the full forward's
    logits: a row's sinks start where its first real token comes, in whatever pass it comes."""
    from transformers import DynamicCache
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=2, top_k=1, sink_tokens=2))
    ids, mask, position_ids, pad = _left_padded(random_ids(1, 36, seed=3), random_ids(1, 27, seed=4))
    full = _logits(model, ids, attention_mask=mask, position_ids=position_ids)
    cache, parts, start = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for size in chunks:
            end = start + size
            parts.append(model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=position_ids[:, start:end],
                               **{cache_keyword(model): cache}).logits)
            start = end
    got = torch.cat(parts, dim=1)
    torch.testing.assert_close(got[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, pad:], full[1, pad:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sfa", [False, True])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_sequences_match_each_alone(arch, mode, sinks, sfa):
    """Sequences packed into one row with restarting position ids (as transformers' DataCollatorWithFlattening
    packs them; transformers then masks across them) give each token the logits it has in its sequence alone:
    each sequence's sinks are its own first tokens, not the row's."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    configs = [sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=sinks, mode=mode)]
    sa.compose(model, *configs, *([sa.SFAConfig(topk=4)] if sfa else []))
    lengths = (SEQ - 19, 7, 12)
    parts = [random_ids(1, length, seed=10 + i) for i, length in enumerate(lengths)]
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    packed = _logits(model, torch.cat(parts, dim=1), position_ids=position_ids)
    alone = torch.cat([_logits(model, part) for part in parts], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def _draft_tree_mask(prompt: int, parents: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [1, 1, n, prompt + n], depths [n]) for n draft tokens after a cached prompt of ``prompt`` tokens;
    ``parents[i]`` is draft i's parent draft (None: it follows the prompt's last token). The mask is additive
    (float32, 0 = attend), the form eager attention takes."""
    mask = torch.zeros(len(parents), prompt + len(parents), dtype=torch.bool)
    mask[:, :prompt] = True
    depths = []
    for draft in range(len(parents)):
        ancestor, depth = draft, -1
        while ancestor is not None:
            mask[draft, prompt + ancestor], ancestor, depth = True, parents[ancestor], depth + 1
        depths.append(depth)
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None], torch.tensor(depths)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_drafts_verified_over_a_cache_score_as_their_path_or_are_refused_as_a_tree(arch, mode, sinks):
    """Speculative decoding verifies draft tokens in one pass over the prompt's cache under a 4D mask. A chain of
    drafts gives the logits of the prompt and drafts in one forward; a tree (two drafts after one token) is refused
    naming the mask, since Focus's window counts key slots and a branch's drafts would see another window than on
    their own path. Without Focus the tree scores each path."""
    from transformers import DynamicCache
    model = tiny_model(arch)
    plain = eager_copy(model)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=2, top_k=1, sink_tokens=sinks, mode=mode))
    prompt, drafts = random_ids(1, 20, seed=3), random_ids(1, 4, seed=5)

    def verify(network, parents):
        mask, depths = _draft_tree_mask(prompt.shape[1], parents)
        cache = DynamicCache(config=network.config)
        with torch.no_grad():
            network(prompt, **{cache_keyword(network): cache})
            return network(drafts, attention_mask=mask, position_ids=prompt.shape[1] + depths[None],
                           **{cache_keyword(network): cache}).logits

    chain = verify(model, [None, 0, 1, 2])
    torch.testing.assert_close(chain, _logits(model, torch.cat([prompt, drafts], 1))[:, 20:], rtol=0, atol=1e-5)
    tree = [None, None, 0, 1]  # paths 0-2 and 1-3
    with pytest.raises(ValueError, match="attn_mask: .*Focus's window counts key slots.* position 21 attends earlier "
                                         "tokens but not position 20"):
        verify(model, tree)
    scored = verify(plain, tree)
    for path in ([0, 2], [1, 3]):
        alone = _logits(plain, torch.cat([prompt, drafts[:, path]], 1))[:, 20:]
        torch.testing.assert_close(scored[:, path], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt-neox", "falcon", "gpt-bigcode"])
def test_models_that_name_their_cache_layer_past_generate_what_recomputation_gives(kind):
    """GPT-NeoX, Falcon and GPT-BigCode hand the cache to their attention modules as ``layer_past``: the routing of
    cached tokens is kept with it (their cached generate was refused before)."""
    import transformers as tf
    # No end-of-text token inside the vocabulary: generate would stop a row there, recomputation would not.
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    small = dict(common, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = {"gpt-neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, intermediate_size=64)),
             "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(**small)),
             "gpt-bigcode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(**common, n_embd=64, n_layer=2,
                                                                                n_head=4))}[kind]().eval()
    try:
        sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=2))
    except ValueError as refusal:  # Falcon took the attention interface after transformers 5.17
        if "computes attention itself" not in str(refusal):
            raise
        pytest.skip(f"this transformers version computes {kind}'s attention itself")
    prompt = random_ids(2, 20, seed=7)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(out, greedy_recompute(model, prompt, 8))


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_prompt_lookup_generation_equals_recomputation(arch, mode, monkeypatch):
    """Assisted generation (prompt lookup) verifies a chain of drafts in one pass, then crops the rejected ones from
    the dynamic cache; the routing kept for cached tokens follows by position, so the tokens are those of
    recomputing the whole sequence at every step."""
    from transformers import DynamicCache
    dropped, real_crop = [], DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda cache, length: (
        dropped.append(cache.get_seq_length() - length), real_crop(cache, length))[1])
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=2, mode=mode))
    part = random_ids(1, 10, seed=2)
    prompt = torch.cat([part, part, part], dim=1)  # repeats, so prompt lookup finds drafts
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                             prompt_lookup_num_tokens=4)
    assert torch.equal(out, greedy_recompute(model, prompt, 16))
    assert max(dropped) > 0  # rejected drafts were cropped


# 4. Causality.

def _future_changed(ids: torch.Tensor, last: int = 5) -> torch.Tensor:
    other = ids.clone()
    other[:, -last:] = (ids[:, -last:] + 1 + torch.arange(last)) % 100
    return other


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_causal_modes_do_not_see_the_future(arch, mode):
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(**SPARSE, mode=mode))
    ids = random_ids()
    a, b = _logits(model, ids), _logits(model, _future_changed(ids))
    torch.testing.assert_close(a[:, :-5], b[:, :-5], rtol=0, atol=1e-6)
    assert (a[:, -5:] - b[:, -5:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_train_mode_sees_the_future(arch):
    """Mode "train" normalises with Sinkhorn over the whole sequence: it is not causal (DESIGN.md, decision 1).
    This also shows that the causality test above detects a leak."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(**SPARSE, mode="train"))
    ids = random_ids()
    a, b = _logits(model, ids), _logits(model, _future_changed(ids))
    assert (a[:, :-5] - b[:, :-5]).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_causal_training_routing_does_not_see_the_future(arch):
    """train_routing="causal" trains with the inference routing: mode "train" is then causal too."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(**SPARSE, mode="train", train_routing="causal"))
    ids = random_ids()
    a, b = _logits(model, ids), _logits(model, _future_changed(ids))
    torch.testing.assert_close(a[:, :-5], b[:, :-5], rtol=0, atol=1e-6)
    assert (a[:, -5:] - b[:, -5:]).abs().max() > 1e-3


def test_causal_training_routing_trains_the_router_and_its_biases():
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE, mode="train", train_routing="causal"))
    layer = next(iter(focus_layers(model)))
    layer.router.train()
    ids = random_ids()
    model(ids, labels=ids).loss.backward()
    assert layer.router.proj.weight.grad.abs().sum() > 0 and layer.router.centroids.grad.abs().sum() > 0
    assert layer.router.group_bias.abs().sum() > 0  # running Sinkhorn potentials, updated in training mode


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("train_routing", ["causal", "sinkhorn"])
def test_activation_checkpointing_changes_no_gradient_and_no_bias(train_routing, reentrant):
    """A checkpointed layer runs its forward again inside backward; the routers' running biases must move once
    per step all the same, and the recomputed routing must be the one the loss saw."""
    ids = random_ids()

    def step(checkpointing: bool):
        torch.manual_seed(0)
        model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE, mode="train", train_routing=train_routing))
        model.train()
        if checkpointing:  # transformers 5.2x renamed gradient_checkpointing_enable
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        for _ in range(2):
            model(ids, labels=ids, use_cache=False).loss.backward()
        routers = [layer.router for layer in focus_layers(model)]
        return [(r.centroids.grad, r.proj.weight.grad, r.group_bias) for r in routers]

    plain, checkpointed = step(False), step(True)
    for expected, got in zip(plain, checkpointed):
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_cache_pickles_after_a_focus_pass_and_a_loaded_copy_is_refused_clearly():
    from transformers import DynamicCache
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(random_ids(1, 14), **{cache_keyword(model): cache})
    loaded = pickle.loads(pickle.dumps(cache))
    assert loaded.get_seq_length() == 14
    with pytest.raises(RuntimeError, match="the KV cache holds 14 tokens but the router has seen none of them"):
        model(random_ids(1, 2, seed=5), **{cache_keyword(model): loaded})


def test_a_cache_filled_under_other_focus_settings_is_refused_clearly():
    """The routing kept for cached tokens belongs to the settings that routed them: after a change of mode the
    cache's tokens have no routing under the new one, and the error says what to do."""
    from transformers import DynamicCache
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(random_ids(1, 10), **{cache_keyword(model): cache})
        sa.set_focus_mode(model, "soft")
        with pytest.raises(RuntimeError, match="the KV cache holds 10 tokens but the router has seen none of them "
                                               "under the current Focus settings; run the whole prompt"):
            model(random_ids(1, 1, seed=5), **{cache_keyword(model): cache})


def test_a_composed_model_pickles_and_copies():
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE), sa.SFAConfig(topk=4))
    ids = random_ids()
    expected = _logits(model, ids)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = (pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False), copy_module.deepcopy(model))
    for copy in copies:
        torch.testing.assert_close(_logits(copy, ids), expected, rtol=0, atol=0)
        out = copy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        assert out.shape == (ids.shape[0], ids.shape[1] + 3)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_attention_weights_are_refused(arch):
    model = sa.compose(tiny_model(arch), sa.FocusConfig(**SPARSE))
    with pytest.raises(ValueError, match="output_attentions: expected False"):
        model(random_ids(), output_attentions=True)


def test_attention_dropout_in_training_is_refused_with_the_setting_to_change():
    model = sa.compose(tiny_model("gpt2", attn_pdrop=0.1), sa.FocusConfig(**SPARSE))
    model.train()
    with pytest.raises(ValueError, match="dropout: expected 0 .*attn_pdrop"):
        model(random_ids())


# 5. Decoding with a KV cache equals recomputing the whole sequence.

@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "mistral"])
def test_kv_cache_generation_equals_recomputation(arch, mode):
    """Prompt 20 + 12 new tokens; Focus window 4, top_k 1 of 4 groups; Gemma-2's and Mistral's sliding window (8)
    is shorter than the sequence, so their sliding-window cache layers drop old keys while decoding."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1, mode=mode))
    prompt, new = random_ids(2, 20, seed=7), 12
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    full = _logits(model, out.sequences[:, :-1])
    sa.set_focus_mode(model, "hard")
    attended, candidates = _pair_fraction(model, out.sequences[:, :-1])
    sa.set_focus_mode(model, mode)
    # the pattern is sparse, and not just the window and the sink token: the groups add pairs, in each of 2 layers
    length = out.sequences.shape[1] - 1
    assert 2 * (_local_pairs(2, length, 4) + 2 * length) < attended < 0.9 * candidates

    cached = torch.stack(out.logits, dim=1)  # [B, new, V]: the logits each decoding step produced
    torch.testing.assert_close(cached[:, -1], full[:, -1], rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, full[:, prompt.shape[1] - 1:], rtol=0, atol=1e-5)
    assert torch.equal(out.sequences, greedy_recompute(model, prompt, new))


@pytest.mark.parametrize("methods", ["focus", "sfa", "focus+sfa"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_generate_compiles_a_static_cache_decode_step(arch, methods):
    """transformers' generate compiles the decode step over a static cache (on CUDA by default; here on the CPU, as
    its private switch allows, with the aot_eager backend, no C compiler needed). The attention runs outside the
    graphs: the decode gives recomputation's tokens, and the step compiles once, not once per cache length."""
    from transformers import CompileConfig
    model = tiny_model(arch)
    torch.manual_seed(0)
    configs = {"focus": sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=2), "sfa": sa.SFAConfig(topk=4)}
    sa.compose(model, *(configs[method] for method in methods.split("+")))
    prompt = random_ids(2, 20, seed=7)
    compile_config = CompileConfig(backend="aot_eager", mode="default")
    compile_config._compile_all_devices = True
    graphs = []
    for new in (4, 10):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                                 cache_implementation="static", compile_config=compile_config)
        assert torch.equal(out, greedy_recompute(model, prompt, new))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0]


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_each_cache_keeps_its_own_routing(mode):
    """The routing of cached tokens belongs to their cache: prefilling another cache, scoring other text without
    one, or changing a setting that does not route (the backend) between two passes over a cache does not change
    what it continues with."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1, mode=mode))
    a, b = random_ids(1, 20, seed=1), random_ids(1, 24, seed=2)
    from transformers import DynamicCache
    with torch.no_grad():
        cache_a, cache_b = DynamicCache(config=model.config), DynamicCache(config=model.config)
        name = cache_keyword(model)
        model(a[:, :12], **{name: cache_a})
        model(b, **{name: cache_b})
        model(b, use_cache=False)
        sa.reconfigure(model, backend="reference")
        continued = model(a[:, 12:], **{name: cache_a}).logits
    torch.testing.assert_close(continued, _logits(model, a)[:, 12:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static", "SFACache"])
def test_a_copied_prompt_cache_continues_each_suffix(cache):
    """transformers' prompt reuse: one prefill of a shared prefix, a copy.deepcopy of its cache per continuation.
    The routing kept for the cached tokens travels with each copy; a copy whose rows are then reordered by hand
    is still refused."""
    from transformers import DynamicCache, StaticCache
    model = tiny_model("llama")
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1),
               *([sa.SFAConfig(topk=4)] if cache == "SFACache" else []))
    prefix = random_ids(1, 14, seed=3)
    prefilled = {"dynamic": lambda: DynamicCache(config=model.config),
                 "static": lambda: StaticCache(config=model.config, max_cache_len=32),
                 "SFACache": lambda: sa.SFACache(model)}[cache]()
    name = cache_keyword(model)
    with torch.no_grad():
        model(prefix, **{name: prefilled})
    for seed in (5, 6):
        ids = torch.cat([prefix, random_ids(1, 4, seed=seed)], dim=1)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             **{name: copy_module.deepcopy(prefilled)})
        assert torch.equal(out, greedy_recompute(model, ids, 5))
    if cache == "dynamic":
        reordered = copy_module.deepcopy(prefilled)
        reordered.reorder_cache(torch.tensor([0]))
        with pytest.raises(RuntimeError, match="reordered"):
            model(random_ids(1, 2, seed=8), **{name: reordered})


@pytest.mark.parametrize("mode, with_sfa, cache", [("hard", False, "dynamic"), ("soft", False, "dynamic"),
                                                   ("hard", False, "static"), ("hard", True, "dynamic"),
                                                   ("hard", True, "SFACache")],
                         ids=["hard", "soft", "hard, static cache", "hard + sfa", "hard + sfa, SFACache"])
def test_beam_search_routes_each_beam_with_its_own_groups(mode, with_sfa, cache):
    """Beam search reorders the cache's rows between steps (a static cache in place); the routing kept for the
    cached tokens follows them, so the beams and their scores are those of beam search recomputing every step
    without a cache."""
    configs = [sa.FocusConfig(num_groups=4, window=2, top_k=1, mode=mode)] + \
        ([sa.SFAConfig(topk=4)] if with_sfa else [])
    torch.manual_seed(0)
    model = sa.compose(tiny_model("llama"), *configs)
    prompt = random_ids(2, 12, seed=7)
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, num_beams=3, num_return_sequences=3,
                    do_sample=False, length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    cache_setting = {cache_keyword(model): sa.SFACache(model)} if cache == "SFACache" else \
        dict(cache_implementation="static") if cache == "static" else {}
    with torch.no_grad():
        cached = model.generate(prompt, **settings, **cache_setting)
        recomputed = model.generate(prompt, **settings, use_cache=False)
    assert torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(cached.sequences_scores, recomputed.sequences_scores, rtol=0, atol=1e-5)
    # the beams part ways: a reordering that kept every row in place would not test the routing's
    assert len({tuple(row.tolist()) for row in cached.sequences[:3, prompt.shape[1]:]}) == 3


def test_beam_search_over_a_left_padded_batch_keeps_each_rows_sinks():
    """The rows' first real positions (where their sinks start) follow the beams too: the padded prompt's beams
    and scores are those it gets alone, and those of recomputing every step."""
    torch.manual_seed(0)
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=2, top_k=1, sink_tokens=2))
    ids, mask, _, pad = _left_padded(random_ids(1, 14, seed=3), random_ids(1, 9, seed=4))
    settings = dict(max_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False, length_penalty=0.0,
                    return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, **settings)
        recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
        alone = model.generate(ids[1:, pad:], attention_mask=mask[1:, pad:], **settings)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert torch.equal(cached.sequences[3:, pad:], alone.sequences)
    torch.testing.assert_close(cached.sequences_scores[3:], alone.sequences_scores, rtol=0, atol=1e-5)


def test_a_prompt_cache_repeated_for_several_continuations():
    """Rows repeated through the model's _reorder_cache carry their routing: each continues as the repeated
    prompt would; repeated by the cache's own batch_repeat_interleave, they are refused, naming the way that works."""
    from transformers import DynamicCache
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE))
    prompt, suffixes = random_ids(1, 14), random_ids(2, 3, seed=5)
    name = cache_keyword(model)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, **{name: cache})
        model._reorder_cache(cache, torch.tensor([0, 0]))
        continued = model(suffixes, **{name: cache}).logits
    whole = _logits(model, torch.cat([prompt.expand(2, -1), suffixes], dim=1))[:, -3:]
    torch.testing.assert_close(continued, whole, rtol=0, atol=1e-5)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, **{name: cache})
        cache.batch_repeat_interleave(2)
        with pytest.raises(RuntimeError, match=r"\(batch 1, now 2\).*must go through model._reorder_cache"):
            model(suffixes, **{name: cache})


def test_rows_reordered_outside_beam_search_are_refused():
    """Rows reordered other than through the model's ``_reorder_cache`` leave the kept routing behind: refused."""
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=2, top_k=1))
    ids = random_ids(2, 12, seed=7)
    from transformers import DynamicCache
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], **{cache_keyword(model): cache})
        cache.reorder_cache(torch.tensor([1, 0]))
        with pytest.raises(RuntimeError, match="batch rows were reordered, selected or repeated between passes"):
            model(ids[:, 8:], **{cache_keyword(model): cache})


def _offloading_cache(model, monkeypatch):
    """A dynamic cache that behaves as ``DynamicCache(offloading=True)`` does on a GPU: each layer's update first
    brings the next layer's keys and values back (a copy), then moves its own away (another copy), so their storage
    changes between passes. On a GPU the real one is used."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache
    if torch.cuda.is_available():
        return DynamicCache(config=model.config, offloading=True)
    update = Cache.update

    def copying_update(cache, keys, values, layer_idx, *args, **kwargs):
        following = cache.layers[(layer_idx + 1) % len(cache.layers)]
        if following.is_initialized:  # prefetched
            following.keys, following.values = following.keys.clone(), following.values.clone()
        cache.offloading = False  # the real offloading needs CUDA streams
        try:
            out = update(cache, keys, values, layer_idx, *args, **kwargs)
        finally:
            cache.offloading = True
        layer = cache.layers[layer_idx]  # offloaded
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        return out

    monkeypatch.setattr(Cache, "update", copying_update)
    cache = DynamicCache(config=model.config)
    cache.offloading = True
    return cache


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_an_offloading_cache_generates_what_recomputation_gives(mode, monkeypatch):
    """An offloading cache moves each layer's keys away and back between passes (new storage each time): not a
    reordering of its rows, so it is not refused, and decoding gives recomputation's tokens."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sa.compose(model.to(device), sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=2, mode=mode))
    prompt = random_ids(2, 20, seed=7).to(device)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                             **{cache_keyword(model): _offloading_cache(model, monkeypatch)})
    assert torch.equal(out, greedy_recompute(model, prompt, 12))


def _hand_built_attention(hidden, window: int, sinks: int, top_k: int = None, gate: str = None, gate_lambda=10.0,
                          dtype: torch.dtype = torch.float64):
    """An attention-interface function computing Focus from its definition, in ``dtype``, from the router's
    parameters and the layer's input ``hidden[id(module)]``. The router's logits are rms(W h_j) C^T / tau + b. Hard
    (``top_k``): token j is a member of its top_k groups (the sinks of every group); query i attends key j <= i when
    i - j <= window or they share a group. Soft (``gate``): memberships softmax(logits) (the sinks' all ones), and
    a pair outside the window adds log(a_ij + 1e-6) to its logit ("log") or multiplies it by sigmoid(gate_lambda
    a_ij) ("multiplicative"), a_ij the dot product of the two memberships. Both within transformers' mask."""
    def attention(module, q, k, v, attention_mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None,
                  **kwargs):
        router = module.sieve_focus.router
        projected = hidden[id(module)].to(dtype) @ router.proj.weight.to(dtype).t()
        projected = projected / torch.sqrt(projected.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = projected @ router.centroids.to(dtype).t() / router.config.tau + router.group_bias.to(dtype)
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None]
        local = (j <= i) & (i - j <= window)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).to(dtype), v.repeat_interleave(group, 1).to(dtype)
        scores = q.to(dtype) @ k.transpose(-1, -2) * (scaling or q.shape[-1] ** -0.5)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = (j <= i)[None].expand(q.shape[0], -1, -1)
        if top_k is not None:
            member = torch.zeros(logits.shape, dtype=torch.bool).scatter_(-1, logits.topk(top_k, -1).indices, True)
            member[:, :sinks] = True
            shared = (member[:, :, None, :] & member[:, None, :, :]).any(-1)
            allowed = allowed & (local | shared)
        else:
            assign = logits.softmax(-1)
            assign[:, :sinks] = 1.0
            affinity = (assign @ assign.transpose(-1, -2))[:, None]
            gated = scores + torch.log(affinity + 1e-6) if gate == "log" else \
                scores * torch.sigmoid(gate_lambda * affinity)
            scores = torch.where(local, scores, gated)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, 0]
        out = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
        return out.to(q.dtype).transpose(1, 2).contiguous(), None
    return attention


def _against_hand_built(model, config, attention):
    """Logits of ``model`` composed with ``config`` (biased routers) and of the same model through ``attention``
    (:func:`_hand_built_attention`'s function of the hidden states it is given)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    torch.manual_seed(0)
    sa.compose(model, config)
    for layer in focus_layers(model):
        layer.router.group_bias.copy_(torch.randn(config.num_groups) * 5)
    ids = random_ids(2, SEQ, seed=3)
    got = _logits(model, ids)
    hidden = {}
    for _, module in attention_modules(model):
        module.register_forward_pre_hook(
            lambda m, args, kwargs: hidden.__setitem__(id(m), kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True)
    AttentionInterface.register("sieve_test_hand_built", attention(hidden))
    AttentionMaskInterface.register("sieve_test_hand_built", sdpa_mask)
    model.set_attn_implementation("sieve_test_hand_built")
    return got, _logits(model, ids)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral", "gpt2"])
def test_hard_pattern_is_the_routers_groups_sinks_and_window(arch):
    """The composed model in hard mode against attention built by hand from the definition (not the package's
    code): biased routers, top-2 of 4 groups, window 3, one sink."""
    config = sa.FocusConfig(num_groups=4, window=3, top_k=2, sink_tokens=1, mode="hard")
    got, expected = _against_hand_built(tiny_model(arch), config, lambda hidden: _hand_built_attention(
        hidden, window=3, sinks=1, top_k=2))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch, gate", [("llama", "log"), ("mistral", "multiplicative"), ("gpt2", "log")])
def test_soft_gate_is_the_memberships_affinity_outside_the_window(arch, gate):
    """Soft mode against the gate built by hand from its definition: causal memberships softmax(logits + b),
    the sink's all ones, pairs past the window gated by the dot product of the two memberships. The logits' error
    against the definition in float64 is at most twice the float32 definition's (plus 1e-6): the routers' logits
    reach about 50 (tau 0.1, biases of 5), so float32 memberships and gates carry errors of about 1e-5 in the
    logits, whose size moves with the CPU's kernels (a fixed 2e-5 failed on an AMD EPYC, at 3.3e-5)."""
    config = sa.FocusConfig(num_groups=4, window=3, sink_tokens=1, gate=gate, gate_lambda=6.0, mode="soft")

    def hand_built(dtype):
        return lambda hidden: _hand_built_attention(hidden, window=3, sinks=1, gate=gate, gate_lambda=6.0,
                                                    dtype=dtype)

    got, exact = _against_hand_built(tiny_model(arch), config, hand_built(torch.float64))
    _, in_float32 = _against_hand_built(tiny_model(arch), config, hand_built(torch.float32))
    bound = 2 * (in_float32 - exact).abs().max().item() + 1e-6
    assert (got - exact).abs().max().item() <= bound


def test_a_model_cast_after_compose_routes_in_float32_as_one_cast_before():
    """Casting the composed model casts its routers too; they still route in float32, as the routers of a model
    composed after the cast (float32 parameters) do."""
    torch.manual_seed(0)
    after = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4, top_k=1)).to(torch.bfloat16)
    before = sa.compose(tiny_model("llama").to(torch.bfloat16), sa.FocusConfig(num_groups=4, window=4, top_k=1))
    before.load_state_dict(after.state_dict())  # the same (bfloat16-rounded) routers, held in float32
    assert next(focus_layers(after)).router.proj.weight.dtype == torch.bfloat16
    ids = random_ids(2, SEQ)
    torch.testing.assert_close(_logits(after, ids), _logits(before, ids), rtol=0, atol=0)


STATIC_CONFIGS = {"focus hard": [sa.FocusConfig(num_groups=4, window=4, top_k=1, mode="hard")],
                  "focus soft": [sa.FocusConfig(num_groups=4, window=4, top_k=1, mode="soft")],
                  "sfa": [sa.SFAConfig(topk=4)],
                  "focus hard + sfa": [sa.FocusConfig(num_groups=4, window=4, top_k=1), sa.SFAConfig(topk=4)]}


@pytest.mark.parametrize("configs", list(STATIC_CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])
def test_static_cache_generation_equals_recomputation(arch, configs):
    """transformers' static cache hands the attention all its slots, the later ones empty, and on the prefill no
    mask (SDPA's top-left causal alignment); the composed model sees only the filled ones. Prompt 20 + 12 new
    tokens in a cache of 32 slots; Gemma-2's and Mistral's sliding layers (window 8) fill and roll."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, *STATIC_CONFIGS[configs])
    prompt, new = random_ids(2, 20, seed=7), 12
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, cache_implementation="static")
    full = _logits(model, out.sequences[:, :-1])
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full[:, prompt.shape[1] - 1:], rtol=0, atol=1e-5)
    assert torch.equal(out.sequences, greedy_recompute(model, prompt, new))


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "mistral"])
def test_left_padded_generation_equals_unpadded(arch, mode, sinks):
    """Batched greedy generation of a left-padded batch gives the shorter prompt the tokens and per-step logits it
    gets alone: padding, position ids, the KV cache and the sinks (its own first tokens) together."""
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=sinks, mode=mode))
    ids, mask, _, pad = _left_padded(random_ids(1, 20, seed=3), random_ids(1, 14, seed=4))
    kwargs = dict(max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **kwargs)
        alone = model.generate(ids[1:, pad:], attention_mask=mask[1:, pad:], **kwargs)
    torch.testing.assert_close(torch.stack(batched.logits, 1)[1], torch.stack(alone.logits, 1)[0], rtol=0,
                               atol=1e-5)
    assert torch.equal(batched.sequences[1, pad:], alone.sequences[0])


# 8. Adapters.

def _composed(arch="llama", seed=0, router_seed=0, **config):
    model = tiny_model(arch, seed=seed)
    torch.manual_seed(router_seed)
    return sa.compose(model, sa.FocusConfig(**({"num_groups": 4, "window": 4, "top_k": 1} | config)))


def test_adapter_round_trip(tmp_path):
    model = _composed()
    for layer in focus_layers(model):  # the causal biases are part of the adapter too
        layer.router.group_bias.copy_(torch.randn(4))
    ids = random_ids()
    expected = _logits(model, ids)
    sa.save_adapter(model, tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.safetensors", "adapter_config.json"]
    saved = load_file(str(tmp_path / "adapter.safetensors"))
    layer_names = [name for name, _ in attention_modules(model)]
    assert set(saved) == {f"{name}.sieve_focus.router.{t}" for name in layer_names
                          for t in ("proj.weight", "centroids", "group_bias")}
    assert sum(t.numel() for t in saved.values()) == 2 * (64 * 16 + 4 * 16 + 4)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["focus"] == model.sieve_config.to_dict()

    fresh = tiny_model("llama")
    torch.manual_seed(123)  # routers initialised differently: only the loaded tensors can make the logits agree
    assert sa.load_adapter(fresh, tmp_path) is fresh
    assert fresh.sieve_config == model.sieve_config
    torch.testing.assert_close(_logits(fresh, ids), expected, rtol=0, atol=0)
    assert not any(p.requires_grad for n, p in fresh.named_parameters() if ".sieve_focus." not in n)

    unloaded = _composed(router_seed=123)
    assert (_logits(unloaded, ids) - expected).abs().max() > 1e-3  # the routers do matter

    same_config = _composed(router_seed=5, mode="soft")  # composed already, same config in another mode: accepted
    sa.load_adapter(same_config, tmp_path)
    assert same_config.sieve_config.mode == "soft"  # the model's own choice stays
    sa.set_focus_mode(same_config, "hard")
    torch.testing.assert_close(_logits(same_config, ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize("other", [dict(arch="llama", hidden_size=32, intermediate_size=64),
                                   dict(arch="llama", num_hidden_layers=3),
                                   dict(arch="qwen3"), dict(arch="mistral")])
def test_load_adapter_refuses_another_model(tmp_path, other):
    sa.save_adapter(_composed(), tmp_path)
    other = dict(other)
    model = tiny_model(other.pop("arch"), **other)
    with pytest.raises(ValueError, match="model"):
        sa.load_adapter(model, tmp_path)
    assert not hasattr(model, "sieve_config") or model.sieve_config is None


@pytest.mark.parametrize("change", [dict(window=8), dict(num_groups=2), dict(sink_tokens=0)])
def test_load_adapter_refuses_another_focus_config(tmp_path, change):
    sa.save_adapter(_composed(), tmp_path)
    with pytest.raises(ValueError, match="model"):
        sa.load_adapter(_composed(**change), tmp_path)


def test_load_adapter_keeps_the_models_inference_settings(tmp_path):
    """top_k, like mode and backend, only says how hard routing uses the routers (reconfigure changes it freely):
    a model composed with another value takes the adapter and keeps its own."""
    trained = _composed()
    sa.save_adapter(trained, tmp_path)
    from sieve_attn.integrations.transformers import adapter_state

    other_top_k = 1 if trained.sieve_config.top_k != 1 else 2
    model = _composed(top_k=other_top_k)
    sa.load_adapter(model, tmp_path)
    assert model.sieve_config.top_k == other_top_k
    for a, b in zip(adapter_state(trained).values(), adapter_state(model).values()):
        assert torch.equal(a, b)


def test_reconfigure_refuses_unknown_and_fixed_settings():
    model = _composed()
    with pytest.raises(ValueError, match="topk: expected one of FocusConfig's settings .*, got a name FocusConfig "
                                         "does not have"):
        sa.reconfigure(model, topk=2)
    with pytest.raises(ValueError, match="num_groups: expected the router's own value"):
        sa.reconfigure(model, num_groups=8)


def test_compose_refuses_twice_and_bad_configs():
    model = _composed()
    with pytest.raises(ValueError, match="model"):
        sa.compose(model, sa.FocusConfig())
    for bad in (None, {"num_groups": 4}, sa.FocusConfig().to_dict(), "focus"):
        plain = tiny_model("llama")
        with pytest.raises(ValueError, match="config"):
            sa.compose(plain, bad)
        assert all(p.requires_grad for p in plain.parameters())  # a refused compose changes nothing
        assert plain.config._attn_implementation != "sieve_focus"



def _unfit_model(kind: str):
    """A tiny model whose attention Focus and SFA cannot replace."""
    import transformers as tf
    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "bloom":  # computes attention itself
        return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4))
    if kind == "mpt":  # computes attention itself, and its attn_config is a sub-config no submodel owns
        return tf.MptForCausalLM(tf.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4))
    if kind == "falcon-alibi":
        return tf.FalconForCausalLM(tf.FalconConfig(**small, alibi=True))
    if kind == "gpt-oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(**small, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                                    num_local_experts=4, num_experts_per_tok=2))
    return tf.BartForConditionalGeneration(tf.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1,
                                                         decoder_layers=1, encoder_attention_heads=2,
                                                         decoder_attention_heads=2, encoder_ffn_dim=32,
                                                         decoder_ffn_dim=32, max_position_embeddings=64))


def _attention_implementations(config) -> list:
    """The attention implementation of config and of its sub-configs, depth first."""
    subs = [getattr(config, name) for name in config.sub_configs if getattr(config, name) is not None]
    return [config._attn_implementation] + [_attention_implementations(sub) for sub in subs]


@pytest.mark.parametrize("kind, message", [
    ("bloom", "model: expected a model whose attention runs through transformers' attention interface, got "
              "BloomForCausalLM, which computes attention itself"),
    ("mpt", "model: expected a model whose attention runs through transformers' attention interface, got "
            "MptForCausalLM, which computes attention itself"),
    ("falcon-alibi", "model: expected a model without ALiBi position biases .*got FalconForCausalLM with alibi=True"),
    ("gpt-oss", "model: expected attention without learned attention sinks .*got model.layers.0.self_attn.sinks"),
    ("bart", "model: expected causal \\(decoder\\) self-attention modules only, got "
             "model.decoder.layers.0.encoder_attn \\(BartAttention, not causal\\)")])
def test_compose_refuses_attention_it_cannot_replace(kind, message):
    """Each of these composed silently before, and then ran its own attention unchanged (BLOOM), dropped a bias
    or the learned sinks from the logits (Falcon with ALiBi, GPT-OSS), or failed only when generating (BART)."""
    model = _unfit_model(kind).eval()
    implementations = _attention_implementations(model.config)
    with pytest.raises(ValueError, match=message):
        sa.compose(model, sa.FocusConfig(**SPARSE))
    assert all(p.requires_grad for p in model.parameters())  # nothing changed
    assert _attention_implementations(model.config) == implementations  # MPT's attn_config was left changed
    assert not any(name.endswith(".sieve_focus") for name, _ in model.named_modules())


def test_a_vision_language_model_composes_its_text_decoder_alone():
    """Gemma-3 with a vision tower: Focus goes into the text decoder's attention only; the tower keeps its own
    attention, so a forward with an image runs (it failed in the tower before). Its image tokens, given their
    token types, attend each other both ways: a causal op would drop those pairs, so that mask is refused."""
    import transformers as tf
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                             boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    vision_implementation = model.config.vision_config._attn_implementation
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=4))  # every group: the dense pattern
    assert [name for name, _ in attention_modules(model)] == [f"model.language_model.layers.{i}.self_attn"
                                                               for i in range(2)]
    assert model.config.vision_config._attn_implementation == vision_implementation
    ids = torch.cat([random_ids(1, 3), torch.full((1, 4), 299), random_ids(1, 5, seed=2)], dim=1)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(_logits(model, ids, pixel_values=pixels)).all()
    with pytest.raises(ValueError, match="attention_mask: expected a causal mask .*got a query that may attend the "
                                         "token after it"):
        _logits(model, ids, pixel_values=pixels, token_type_ids=(ids == 299).long())


def test_an_additive_mask_with_a_bias_is_refused():
    """A float mask passed by hand must only mask (0, or at most -1e4: any float dtype's minimum, -inf, older code's
    -1e4): a finite bias such as ALiBi's would be lost. Inside skip_nan_checks nothing reads the mask's values. An
    integer mask is neither boolean nor additive."""
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(**SPARSE))
    ids = random_ids(1, 12)
    causal = torch.ones(12, 12).tril().bool()
    for masked in (torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min, torch.finfo(torch.float16).min,
                   -1e4, float("-inf")):
        additive = torch.zeros(12, 12).masked_fill(~causal, masked)
        torch.testing.assert_close(_logits(model, ids, attention_mask=additive[None, None]), _logits(model, ids),
                                   rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="attention_mask: expected a boolean mask .* or an additive float one .*got "
                                         "a torch.int64 tensor"):
        _logits(model, ids, attention_mask=causal.long()[None, None])
    biased = additive - 0.5 * (torch.arange(12)[:, None] - torch.arange(12)[None]).clamp_min(0)
    with pytest.raises(ValueError, match="attention_mask: expected an additive mask of 0 .*got other values"):
        _logits(model, ids, attention_mask=biased[None, None])
    with sa.skip_nan_checks():
        _logits(model, ids, attention_mask=biased[None, None])

# 9. Parameter count of the paper's GPT-2 retrofit.

def test_router_parameter_count_gpt2_124m():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    sa.compose(model, sa.FocusConfig(num_groups=4, group_dim=16))
    routers = [m for m in model.modules() if isinstance(m, FocusRouter)]
    assert len(routers) == 12
    assert sum(p.numel() for r in routers for p in r.parameters()) == 148_224
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 148_224


# 9. The Triton backend inside a model (on the CPU through the Triton interpreter, see tests/conftest.py).

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_triton_backend_generation_equals_reference_and_recomputation(arch):
    """backend='triton': the prompt goes through the pair-set kernels, every decoding step through the decode
    kernel (which reads only the window and the query's groups). Logits equal the reference backend's; greedy tokens
    equal recomputing the whole sequence each step."""
    skip_without_cpu_kernels()
    model = tiny_model(arch)
    torch.manual_seed(0)
    sa.compose(model, sa.FocusConfig(num_groups=4, window=4, top_k=2, backend="triton"))
    prompt, new = random_ids(2, 20, seed=7), 6
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        fast = model.generate(prompt, **kwargs)
    sa.reconfigure(model, backend="reference")
    with torch.no_grad():
        reference = model.generate(prompt, **kwargs)
    torch.testing.assert_close(torch.stack(fast.logits, 1), torch.stack(reference.logits, 1), rtol=0, atol=1e-4)
    assert torch.equal(fast.sequences, reference.sequences)
    sa.reconfigure(model, backend="triton")
    assert torch.equal(fast.sequences, greedy_recompute(model, prompt, new))


@pytest.mark.parametrize("config", [sa.FocusConfig(**SPARSE), sa.SFAConfig(topk=4)], ids=["focus", "sfa"])
def test_a_composed_model_runs_under_bf16_autocast_close_to_float32(config):
    """Under autocast transformers' RoPE gives float32 q and k beside a bfloat16 v; the attention function runs all
    three in the autocast dtype, as SDPA does, and the logits stay close to float32's: on average within 10% of
    their mean magnitude (bf16 rounding; for SFA it also flips a few top-k selections, whose logits move more)."""
    model = sa.compose(tiny_model("llama"), config)
    ids = random_ids()
    with torch.no_grad():
        want = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(ids).logits
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().mean() < 0.1 * want.abs().mean()
