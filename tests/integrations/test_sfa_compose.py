"""SFA composed into transformers models, alone and inside the Focus pattern.

Oracle: an uncomposed copy of the same weights running the architecture's own eager attention on q and k whose
coordinates outside their top-k by |x| were zeroed with ``torch.topk`` (random weights make ties impossible), through
an attention function registered for the test only; so no package code computes the expected logits.
"""
from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import sieve_attn as sa
from sieve_attn.integrations.transformers import sfa_layers

try:
    from tests.models import ARCHS, eager_copy, random_ids, threads, tiny_model
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import ARCHS, eager_copy, random_ids, threads, tiny_model

HEAD_DIM = 16  # every tiny config: hidden 64 / 4 heads, or head_dim=16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with threads(1):
        yield


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _topk_only(x: torch.Tensor, topk: int) -> torch.Tensor:
    kept = torch.zeros_like(x).scatter(-1, x.abs().topk(topk, dim=-1).indices, 1.0)
    return x * kept


def _sfa_oracle(model, topk: int):
    """Eager copy whose attention sparsifies q and k (after RoPE: the attention function receives them so)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    reference = eager_copy(model)

    def attention(module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, _topk_only(query, topk), _topk_only(key, topk), value, attention_mask, **kwargs)

    AttentionInterface.register("test_sfa_oracle", attention)
    AttentionMaskInterface.register("test_sfa_oracle", eager_mask)
    reference.set_attn_implementation("test_sfa_oracle")
    return reference


@pytest.mark.parametrize("arch, backend", [(arch, "auto") for arch in ARCHS] + [("llama", "sdpa"), ("qwen2", "sdpa")])
def test_sfa_matches_the_eager_oracle(arch, backend):
    model = tiny_model(arch)
    oracle = _sfa_oracle(model, 4)
    ids = random_ids()
    sa.compose(model, sa.SFAConfig(topk=4, backend=backend))
    expected = _logits(oracle, ids)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)
    assert (expected - _logits(eager_copy(model), ids)).abs().max() > 1e-2  # top-4 of 16 is not dense


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_full_topk_is_the_original_model(arch):
    model = tiny_model(arch)
    expected = _logits(eager_copy(model), random_ids())
    sa.compose(model, sa.SFAConfig(topk=HEAD_DIM))
    torch.testing.assert_close(_logits(model, random_ids()), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_sfa_generation_with_cache_equals_recomputation_and_is_causal(arch):
    model = tiny_model(arch)
    sa.compose(model, sa.SFAConfig(topk=4))
    prompt = random_ids(2, 20, seed=7)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    full = _logits(model, out.sequences[:, :-1])
    torch.testing.assert_close(torch.stack(out.logits, 1), full[:, prompt.shape[1] - 1:], rtol=0, atol=1e-5)
    changed = out.sequences.clone()
    changed[:, -3:] = (changed[:, -3:] + 1) % 100
    torch.testing.assert_close(_logits(model, changed)[:, :-3], _logits(model, out.sequences)[:, :-3], rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_focus_and_sfa_together(arch):
    """SFA inside a degenerate Focus pattern (top_k = K: every pair) is SFA alone; inside a sparse one it differs."""
    ids = random_ids()
    alone = sa.compose(tiny_model(arch), sa.SFAConfig(topk=4))
    torch.manual_seed(0)
    both = sa.compose(tiny_model(arch), sa.FocusConfig(num_groups=4, window=4, top_k=4), sa.SFAConfig(topk=4))
    torch.testing.assert_close(_logits(both, ids), _logits(alone, ids), rtol=0, atol=1e-5)
    sa.reconfigure(both, top_k=1)
    assert (_logits(both, ids) - _logits(alone, ids)).abs().max() > 1e-2


def test_focus_and_sfa_through_the_triton_kernels_equal_the_reference():
    """The fast path of Focus + SFA: the Focus kernels on the sparsified q and k (on the GPU where there is one,
    else in the Triton interpreter)."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = sa.compose(tiny_model("llama").to(device),
                       sa.FocusConfig(num_groups=4, window=4, top_k=2, backend="triton"), sa.SFAConfig(topk=4))
    ids = random_ids(1, 24).to(device)
    fast = _logits(model, ids)
    sa.reconfigure(model, backend="reference")
    torch.testing.assert_close(fast, _logits(model, ids), rtol=0, atol=1e-4)


def test_adapter_round_trip_and_refusal(tmp_path):
    torch.manual_seed(0)
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4, top_k=1), sa.SFAConfig(topk=4))
    sa.save_adapter(model, tmp_path)
    ids = random_ids()
    loaded = sa.load_adapter(tiny_model("llama"), tmp_path)
    assert loaded.sieve_sfa_config == sa.SFAConfig(topk=4)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)
    other = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4, top_k=1), sa.SFAConfig(topk=8))
    with pytest.raises(ValueError, match="model: expected a model composed with the adapter's configs"):
        sa.load_adapter(other, tmp_path)


def test_an_adapter_trained_with_fine_tuned_weights_asks_for_them(tmp_path):
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    sa.save_adapter(model, tmp_path, weights_digest="sha256:0123456789abcdef")
    for given in (None, "sha256:fedcba9876543210"):
        with pytest.raises(ValueError, match="weights_digest: expected sha256:0123456789abcdef, that of the "
                                             "fine-tuned weights the adapter was trained with"):
            sa.load_adapter(tiny_model("llama"), tmp_path, weights_digest=given)
    loaded = sa.load_adapter(tiny_model("llama"), tmp_path, weights_digest="sha256:0123456789abcdef")
    assert loaded.sieve_sfa_config == model.sieve_sfa_config


def test_an_sfa_adapter_fills_the_sfa_part_of_a_focus_and_sfa_model(tmp_path):
    """Focus retrofitted onto an SFA model starts from the SFA adapter: it loads into the SFA layers of a model
    composed with both and leaves the routers alone; a model without SFA, or with another SFA config, refuses it."""
    torch.manual_seed(0)
    sfa_model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, feature_map=True))
    for layer in sfa_layers(sfa_model):
        layer.feature_map.data = torch.linalg.qr(torch.randn_like(layer.feature_map))[0]
    sa.save_adapter(sfa_model, tmp_path)
    focus = sa.FocusConfig(num_groups=4, window=4, top_k=1)
    both = sa.compose(tiny_model("llama"), focus, sa.SFAConfig(topk=4, feature_map=True))
    routers = {k: v.clone() for k, v in both.state_dict().items() if ".sieve_focus." in k}
    sa.load_adapter(both, tmp_path)
    assert all(torch.equal(v, both.state_dict()[k]) for k, v in routers.items())
    assert all(torch.equal(a.feature_map, b.feature_map) for a, b in zip(sfa_layers(both), sfa_layers(sfa_model)))
    sa.set_focus_mode(both, "dense")  # Focus attending every causal pair: SFA alone
    ids = random_ids()
    torch.testing.assert_close(_logits(both, ids), _logits(sfa_model, ids), rtol=0, atol=1e-5)
    for other in (sa.compose(tiny_model("llama"), focus),
                  sa.compose(tiny_model("llama"), focus, sa.SFAConfig(topk=8, feature_map=True))):
        with pytest.raises(ValueError, match="model: expected a model composed with the adapter's configs"):
            sa.load_adapter(other, tmp_path)


def test_an_adapter_fits_any_backend_and_a_misfit_leaves_the_model_plain(tmp_path):
    """The backend only says which kernels compute SFA: an adapter saved with one loads into a model composed with
    another, which keeps its own. Tensors that do not fit are refused before the model changes."""
    torch.manual_seed(0)
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, feature_map=True, backend="sdpa"))
    for layer in sfa_layers(model):
        layer.feature_map.data = torch.linalg.qr(torch.randn_like(layer.feature_map))[0]
    sa.save_adapter(model, tmp_path)
    ids = random_ids()
    composed = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, feature_map=True, backend="reference"))
    sa.load_adapter(composed, tmp_path)
    assert composed.sieve_sfa_config.backend == "reference"
    assert all(layer.config.backend == "reference" for layer in sfa_layers(composed))
    torch.testing.assert_close(_logits(composed, ids), _logits(model, ids), rtol=0, atol=1e-5)

    tensors = load_file(str(tmp_path / "adapter.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name][:1]  # one KV head's map of two
    save_file(tensors, str(tmp_path / "adapter.safetensors"))
    plain = tiny_model("llama")
    implementation = plain.config._attn_implementation
    with pytest.raises(ValueError, match=rf"adapter tensor {name}: expected shape \(2, 16, 16\), got \(1, 16, 16\)"):
        sa.load_adapter(plain, tmp_path)
    assert getattr(plain, "sieve_sfa_config", None) is None and plain.config._attn_implementation == implementation
    assert not list(sfa_layers(plain))
    for damage in (lambda path: path.write_bytes(path.read_bytes()[:-5]), lambda path: path.unlink()):
        damage(tmp_path / "adapter.safetensors")  # cut short, then gone: a ValueError naming the adapter
        with pytest.raises(ValueError, match="^adapter: expected a safetensors file, got .*adapter.safetensors'"):
            sa.load_adapter(plain, tmp_path)


def _matching_terms(topk: int, arch: str = "llama") -> list[torch.Tensor]:
    model = sa.compose(tiny_model(arch), sa.SFAConfig(topk=topk))
    model.requires_grad_(True)  # as conversion fine-tuning does
    layers = list(sfa_layers(model))
    for layer in layers:
        layer.matching = True
    model(random_ids())
    return [t for layer in layers for t in layer.matching_terms]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_matching_terms_measure_the_distance_to_dense(arch):
    """One term per layer and forward pass, differentiable (towards the stop-gradient dense output), zero when SFA
    keeps every coordinate: the dense target is the layer's own attention, causal and under the layer's mask
    (Mistral's sliding window of 8 over these 40 tokens; PyTorch's SDPA computes it) or its softcap (Gemma-2; the
    blockwise reference)."""
    terms = _matching_terms(4, arch)
    assert len(terms) == 2 and all(t.item() > 1e-4 and t.requires_grad for t in terms)
    assert all(t.item() < 1e-10 for t in _matching_terms(HEAD_DIM, arch))


@pytest.mark.parametrize("feature_map, selection", [(False, "magnitude"), (True, "importance")])
def test_sparsity_terms_are_the_energy_the_topk_drops(monkeypatch, feature_map, selection):
    """One residual-energy term per layer and training forward, in (0, 1), differentiable, and 0 at top-k = D;
    none without autograd. By hand on layer 0: the fraction of q's and k's energy (mapped, then selected as the
    layer selects) outside their kept coordinates."""
    from sieve_attn.nn.sfa_layer import residual_energy

    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, feature_map=feature_map, selection=selection))
    layers = list(sfa_layers(model))
    if feature_map:
        with torch.no_grad():
            layers[0].feature_map.copy_(torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM))[0])
    model.requires_grad_(True)
    seen = {}
    attend = type(layers[0]).attend

    def spy(self, q, k, v, **kwargs):
        seen.setdefault(id(self), (q.detach(), k.detach()))
        return attend(self, q, k, v, **kwargs)

    for layer in layers:
        layer.sparsity = True
    monkeypatch.setattr(type(layers[0]), "attend", spy)
    model(random_ids())
    monkeypatch.undo()
    terms = [t for layer in layers for t in layer.sparsity_terms]
    assert len(terms) == 2 and all(0 < t.item() < 1 and t.requires_grad for t in terms)
    q, k = seen[id(layers[0])]
    first = layers[0]
    mapped_q, mapped_k = first._queries_in_basis(q), first._keys_in_basis(k)
    kept = [sa.ops.sfa.codes.sparsify(x, 4) if selection == "magnitude" else select(x)
            for x, select in ((mapped_q, first._select_queries), (mapped_k, first._select_keys))]
    expected = (residual_energy(mapped_q, kept[0]) + residual_energy(mapped_k, kept[1])) / 2
    torch.testing.assert_close(terms[0].detach(), expected, rtol=1e-5, atol=1e-7)
    for layer in layers:
        layer.sparsity_terms.clear()
        layer.topk = HEAD_DIM
    model(random_ids())
    assert all(t.item() == 0 for layer in layers for t in layer.sparsity_terms)
    for layer in layers:
        layer.sparsity_terms.clear()
    with torch.no_grad():
        model(random_ids())
    assert not any(layer.sparsity_terms for layer in layers)


def test_residual_energy_by_hand_and_its_gradient_reaches_the_dropped_coordinates():
    from sieve_attn.nn.sfa_layer import residual_energy

    x = torch.tensor([[3.0, -1.0, 0.5, 2.0], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    kept = sa.ops.sfa.codes.sparsify(x, 2)  # keeps 3 and 2 of the first row
    term = residual_energy(x, kept)
    assert term.item() == pytest.approx((1.25 / 14.25 + 0) / 2)  # the zero vector counts 0
    term.backward()
    grad = x.grad[0]
    # the dropped coordinates are pushed towards 0, the kept ones outward (a larger denominator)
    assert grad[1] < 0 < grad[2] and grad[0] < 0 and grad[3] < 0 and not x.grad[1].any()


@pytest.mark.parametrize("configs, message", [
    ((), "configs: expected a FocusConfig, an SFAConfig, or one of each"),
    ((sa.SFAConfig(topk=2), sa.SFAConfig(topk=3)), "configs: expected"),
    ((sa.SFAConfig(topk=17),), "topk: expected at most the model's head dim 16, got 17"),
])
def test_compose_refuses_bad_configs(configs, message):
    with pytest.raises(ValueError, match=message):
        sa.compose(tiny_model("llama"), *configs)
    with pytest.raises(ValueError, match="topk: expected an int in \\[1"):
        sa.SFAConfig(topk=0)


def test_compose_refuses_the_sdpa_backend_on_a_softcapped_model():
    """Gemma-2 caps its logits; PyTorch's attention cannot: refused when composing, not at the first forward. With
    Focus the Focus backend computes the scores, so it is accepted."""
    with pytest.raises(ValueError, match="^backend: expected an SFA backend that caps logits, as this model does at "
                                         ".*got 'sdpa'"):
        sa.compose(tiny_model("gemma2"), sa.SFAConfig(topk=4, backend="sdpa"))
    sa.compose(tiny_model("gemma2"), sa.FocusConfig(num_groups=4, window=4), sa.SFAConfig(topk=4, backend="sdpa"))


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_compose_refuses_the_triton_backend_on_a_model_with_sliding_windows(arch):
    """Sliding-window layers pass a mask once a sequence outgrows the window; the Triton kernels take none: refused
    when composing, not at the first long forward."""
    with pytest.raises(ValueError, match="^backend: expected an SFA backend that takes a mask, as this model's "
                                         "sliding-window layers pass one past 8 tokens .*got 'triton'"):
        sa.compose(tiny_model(arch), sa.SFAConfig(topk=4, backend="triton"))
    sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, backend="triton"))


def test_only_the_triton_backend_needs_the_layers_windows(monkeypatch):
    """A hybrid model (linear-attention cache layers beside attention ones) has no windows to read; only the
    Triton backend asks for them."""
    import sieve_attn.integrations.transformers as integration

    def unreadable(model):
        raise ValueError("model: expected full or sliding-window attention layers, got a LinearAttentionLayer")

    monkeypatch.setattr(integration, "layer_windows", unreadable)
    for backend in ("auto", "reference", "sdpa"):
        sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, backend=backend))
    with pytest.raises(ValueError, match="LinearAttentionLayer"):
        sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4, backend="triton"))


# (attn_mask passed, backend auto takes on CUDA) of a tiny model's calls: Mistral's sliding window and Gemma-2's local
# layer pass a mask (window 8 < 40 tokens), which sdpa takes; Gemma-2 caps its logits, so its global layer takes the
# Triton kernels and its local one, masked, the reference (neither sdpa nor the kernels compute it).
AUTO_ON_CUDA = {"llama": {(False, "sdpa")}, "mistral": {(True, "sdpa")},
                "gemma2": {(False, "triton"), (True, "reference")}}


@pytest.mark.parametrize("arch", AUTO_ON_CUDA)
def test_auto_on_cuda_runs_sdpa_unless_the_model_caps_logits(arch, monkeypatch):
    """The calls a composed model makes, resolved as on CUDA (a stand-in q of the same shape and dtype: the choice
    reads nothing else): auto takes sdpa, the faster on the H200, except on a model that caps its logits (Gemma-2).
    On the CPU the same calls keep the reference."""
    from types import SimpleNamespace

    import sieve_attn.ops.sfa.attention as attention_module
    from sieve_attn.ops.triton_common import triton

    if arch == "gemma2" and triton is None:
        pytest.skip("triton is not installed")
    calls, resolve = [], attention_module._resolve

    def recording(q, attn_mask, softcap, return_lse, backend):
        calls.append((q, attn_mask, softcap, return_lse, backend))
        return resolve(q, attn_mask, softcap, return_lse, backend)

    monkeypatch.setattr(attention_module, "_resolve", recording)
    model = sa.compose(tiny_model(arch), sa.SFAConfig(topk=4))
    _logits(model, random_ids())
    assert calls and all(call[-1] == "auto" for call in calls)
    on_cuda = [SimpleNamespace(shape=q.shape, device=torch.device("cuda"), dtype=q.dtype) for q, *_ in calls]
    assert {(mask is not None, resolve(cuda_q, mask, *rest)[0])
            for cuda_q, (_, mask, *rest) in zip(on_cuda, calls)} == AUTO_ON_CUDA[arch]
    assert {resolve(*call)[0] for call in calls} == {"reference"}
