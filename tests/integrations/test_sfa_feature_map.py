"""SFA's feature maps (SFAConfig(feature_map=True)): q and k mapped per KV head after RoPE, before the top-k.

Oracles: the model composed without a map (an identity map changes nothing), the plain model (an orthogonal map at
top-k = D preserves every dense score), an explicit per-head loop (GQA), dense softmax attention computed here
(synthetic data whose energy lies in a known subspace), and the full forward without a cache (SFACache).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import sieve_attn as sa
import sieve_attn.nn.sfa_layer as sfa_layer
from sieve_attn.eval.generate import greedy_recompute
from sieve_attn.integrations.transformers import adapter_state, sfa_layers
from sieve_attn.nn.sfa_layer import Moments, SFALayer
from sieve_attn.train.calibrate import _calibrated as calibrated_layer
from sieve_attn.train.finetune import FinetuneSettings, finetune, load_weights

try:
    from tests.integrations.test_sfa_cache import _generate, _step_logits
    from tests.integrations.test_sfa_compose import _logits, _one_thread  # noqa: F401 (an autouse fixture)
    from tests.models import random_ids, tiny_model
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from integrations.test_sfa_cache import _generate, _step_logits
    from integrations.test_sfa_compose import _logits, _one_thread  # noqa: F401 (an autouse fixture)
    from models import random_ids, tiny_model

HEAD_DIM, TOPK, KV_HEADS = 16, 4, 2  # the tiny llama: 4 query heads, 2 KV heads of dim 16
PROMPT, NEW = 20, 8


def _mapped(arch: str = "llama", topk: int = TOPK, seed: int = 0, **overrides):
    return sa.compose(tiny_model(arch, seed=seed, **overrides), sa.SFAConfig(topk=topk, feature_map=True))


def _calibration_windows():
    return random_ids(4, 24, seed=3)


def _calibrated(arch: str = "llama", topk: int = TOPK):
    return sa.calibrate_feature_maps(_mapped(arch, topk), _calibration_windows(), progress=False)


def _maps(model) -> list[torch.Tensor]:
    return [layer.feature_map.detach().clone() for layer in sfa_layers(model)]


def _assert_same_axes(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> None:
    """Maps [Hkv, D, D] of the same columns up to their signs (an eigenvector's sign is arbitrary)."""
    torch.testing.assert_close((a * b).sum(-2).abs(), torch.ones(a.shape[:-2] + a.shape[-1:]), rtol=0, atol=atol)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_identity_maps_change_nothing(arch):
    """At compose every map is the identity [Hkv, D, D] (a parameter, frozen), and the logits are those of the
    model composed without a map."""
    model = _mapped(arch)
    kv_heads = 4 if arch == "gpt2" else KV_HEADS
    for layer in sfa_layers(model):
        assert isinstance(layer.feature_map, torch.nn.Parameter) and not layer.feature_map.requires_grad
        assert torch.equal(layer.feature_map, torch.eye(HEAD_DIM).repeat(kv_heads, 1, 1))
    assert all(layer.feature_map is None for layer in sfa_layers(sa.compose(tiny_model(arch), sa.SFAConfig(TOPK))))
    plain_sfa = sa.compose(tiny_model(arch), sa.SFAConfig(topk=TOPK))
    ids = random_ids()
    torch.testing.assert_close(_logits(model, ids), _logits(plain_sfa, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "qwen3"])
def test_calibrated_maps_are_orthogonal_and_keep_dense_scores(arch):
    """Calibration gives an orthogonal map per KV head (not the identity); at top-k = D the model then computes the
    plain model's logits (an orthogonal map leaves every q . k as it is), run by transformers' eager attention: its
    default for Gemma-2 was SDPA up to 5.17 at least, which drops the logit softcap."""
    model = _calibrated(arch, topk=HEAD_DIM)
    maps = _maps(model)
    eye = torch.eye(HEAD_DIM)
    for m in maps:
        torch.testing.assert_close(m.transpose(-1, -2) @ m, eye.expand_as(m), rtol=0, atol=1e-5)
        assert (m - eye).abs().max() > 0.1  # not a no-op
    ids = random_ids()
    torch.testing.assert_close(_logits(model, ids), _logits(tiny_model(arch, attn_implementation="eager"), ids),
                               rtol=0, atol=1e-4)


def test_calibration_restores_topk_and_ignores_the_maps_it_had():
    """Each layer's top-k in use (here one a warm-up might hold) comes back and ``moments`` is None again; the maps
    come from the dense model whatever maps the layers had before (random ones, as fine-tuning leaves them: not
    orthogonal, so they would change the inputs of the second layer, give the same result)."""
    model = _mapped()
    layers = list(sfa_layers(model))
    layers[0].topk = 6
    sa.calibrate_feature_maps(model, _calibration_windows(), progress=False)
    assert [layer.topk for layer in layers] == [6, TOPK] and all(layer.moments is None for layer in layers)
    first = _maps(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            layer.feature_map.copy_(torch.eye(HEAD_DIM) + torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM,
                                                                      generator=generator))
    sa.calibrate_feature_maps(model, _calibration_windows(), batch_size=3, progress=False)
    for a, b in zip(first, _maps(model)):
        _assert_same_axes(a, b)


def test_calibration_records_the_dense_model():
    """The moments are recorded at top-k = D: a model of top-k 4 gets the maps of the same weights at top-k 16
    (the second layer's inputs would differ if the first ran sparse)."""
    for a, b in zip(_maps(_calibrated(topk=TOPK)), _maps(_calibrated(topk=HEAD_DIM))):
        _assert_same_axes(a, b, atol=1e-5)


def test_moments_are_those_of_the_unmapped_q_and_k():
    """With a (non-identity) map in place, the recorded moments are sums of k k^T per KV head and of q q^T over the
    KV head's query heads (4 on 2: heads 2g and 2g + 1), of q and k as given, with their counts."""
    layer = SFALayer(sa.SFAConfig(topk=TOPK, feature_map=True, backend="reference"), KV_HEADS, HEAD_DIM)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 6, HEAD_DIM, generator=generator)
    k, v = (torch.randn(2, KV_HEADS, 6, HEAD_DIM, generator=generator) for _ in range(2))
    with torch.no_grad():
        layer.feature_map.copy_(torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=generator))
        layer.moments = Moments()
        layer.attend(q, k, v)
        layer.attend(q, k, v)  # the sums run over calls
    moments = layer.moments
    keys, queries = moments.keys / 2, moments.queries / 2
    key_count, query_count = moments.key_count // 2, moments.query_count // 2
    outer = lambda x: torch.einsum("btd,bte->de", x, x)  # noqa: E731
    torch.testing.assert_close(keys, torch.stack([outer(k[:, g]) for g in range(KV_HEADS)]), rtol=1e-5, atol=1e-4)
    expected = torch.stack([outer(q[:, 2 * g]) + outer(q[:, 2 * g + 1]) for g in range(KV_HEADS)])
    torch.testing.assert_close(queries, expected, rtol=1e-5, atol=1e-4)
    assert (key_count, query_count) == (2 * 6, 2 * 2 * 6)


def test_failed_calibration_restores_the_layers():
    """An error in the middle of the windows (a token id outside the vocab) leaves maps, top-k and moments as
    they were."""
    model = _calibrated()
    before = _maps(model)
    windows = torch.cat([_calibration_windows(), torch.full((1, 24), 10_000)])
    with pytest.raises(IndexError):
        sa.calibrate_feature_maps(model, windows, progress=False)
    for layer, old in zip(sfa_layers(model), before):
        assert torch.equal(layer.feature_map, old) and layer.topk == TOPK and layer.moments is None


def test_principal_axes_let_the_topk_keep_the_scores():
    """q and k whose energy lies in a random 3-dim subspace of the 16 coordinates: in their own coordinates the
    top-4 drops much of each score, in the principal axes recorded from them (moments at top-k = D) it keeps
    nearly all. SFA output with the map is far closer to dense attention than without, or than with a random
    orthogonal map."""
    dim, rank, tokens = HEAD_DIM, 3, 64
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=generator))[0][:, :rank]  # orthonormal columns

    def signal(heads):
        latent = 2.0 * torch.randn(1, heads, tokens, rank, generator=generator)
        return latent @ basis.T + 0.05 * torch.randn(1, heads, tokens, dim, generator=generator)

    q, k, v = signal(2), signal(1), torch.randn(1, 1, tokens, dim, generator=generator)  # GQA: 2 heads on 1
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    dense = torch.softmax((q @ k.transpose(-1, -2) * dim ** -0.5).masked_fill(~causal, float("-inf")), -1) @ v
    layer = SFALayer(sa.SFAConfig(topk=TOPK, feature_map=True, backend="reference"), 1, dim)

    def error(out) -> float:
        return (out - dense).pow(2).mean().sqrt().item()

    with torch.no_grad():
        identity = error(layer.attend(q, k, v))
        layer.moments, layer.topk = Moments(), dim
        assert error(layer.attend(q, k, v)) < 1e-5  # top-k = D, identity map: dense attention
        axes = calibrated_layer(layer)[0]
        layer.moments, layer.topk = None, TOPK
        torch.testing.assert_close(axes[0].T @ axes[0], torch.eye(dim), rtol=0, atol=1e-5)
        layer.feature_map.copy_(torch.linalg.qr(torch.randn(1, dim, dim, generator=generator))[0])
        random = error(layer.attend(q, k, v))
        layer.feature_map.copy_(axes)
        mapped = error(layer.attend(q, k, v))
    assert identity > 0.1 and random > 0.1  # the top-4 of 16 spread coordinates loses much
    assert mapped < identity / 10 and mapped < random / 10 and mapped < 0.02


def test_gqa_queries_take_their_kv_heads_map():
    """4 query heads on 2 KV heads: query head h is mapped by the map of KV head h // 2 (transformers' repeat_kv
    grouping), keys by their own head's map; an explicit loop is the reference."""
    model = _mapped()
    layer = next(iter(sfa_layers(model)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.feature_map.copy_(torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=generator))
    q = torch.randn(2, 4, 5, HEAD_DIM, generator=generator)
    k = torch.randn(2, KV_HEADS, 5, HEAD_DIM, generator=generator)
    m = layer.feature_map.detach()
    expected_q = torch.stack([q[:, h] @ m[h // 2] for h in range(4)], dim=1)
    expected_k = torch.stack([k[:, g] @ m[g] for g in range(KV_HEADS)], dim=1)
    torch.testing.assert_close(layer.map_queries(q), expected_q, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer.map_keys(k), expected_k, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(layer.map_queries(q)[:, 1], q[:, 1] @ m[1], atol=1e-3)  # not head h's own map


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_generation_over_the_cache_matches_the_full_forward(arch, monkeypatch):
    """A calibrated model decodes over SFACache (the cache stores mapped key codes; Llama's decode steps read them
    through sfa_decode with mapped queries, Mistral's past its sliding window of 8 and Gemma-2's (softcap) densify
    them): the greedy tokens equal recomputing the whole sequence at each step and the dense-cache path's, and
    every step's logits equal the full forward's to float rounding."""
    decodes = []
    real = sfa_layer.sfa_decode
    monkeypatch.setattr(sfa_layer, "sfa_decode", lambda *a, **kw: decodes.append(a[0].shape) or real(*a, **kw))
    model = _calibrated(arch)
    prompt = random_ids(2, PROMPT, seed=7)
    compressed = _generate(model, prompt, sa.SFACache(model))
    if arch == "llama":
        assert len(decodes) == (NEW - 1) * 2 and all(shape[2] == 1 for shape in decodes)
    dense = _generate(model, prompt)
    assert torch.equal(compressed.sequences, dense.sequences)
    assert torch.equal(compressed.sequences, greedy_recompute(model, prompt, NEW))
    full = _logits(model, compressed.sequences[:, :-1])[:, PROMPT - 1:]
    torch.testing.assert_close(_step_logits(compressed), full, rtol=0, atol=1e-4)
    torch.testing.assert_close(_step_logits(dense), full, rtol=0, atol=1e-4)
    # The maps matter here: the same weights with identity maps decode to other logits.
    identity = _generate(_mapped(arch), prompt)
    assert (_step_logits(identity) - _step_logits(compressed)).abs().max() > 1e-2


def test_adapter_round_trip_carries_the_maps(tmp_path):
    model = _calibrated()
    state = adapter_state(model)
    assert sorted(state) == [f"model.layers.{i}.self_attn.sieve_sfa.feature_map" for i in range(2)]
    sa.save_adapter(model, tmp_path / "adapter")
    fresh = sa.load_adapter(tiny_model("llama"), tmp_path / "adapter")  # composes the plain model first
    assert fresh.sieve_sfa_config == sa.SFAConfig(topk=TOPK, feature_map=True)
    for a, b in zip(_maps(model), _maps(fresh)):
        assert torch.equal(a, b)
    ids = random_ids()
    torch.testing.assert_close(_logits(fresh, ids), _logits(model, ids), rtol=0, atol=0)
    composed = sa.load_adapter(_mapped(), tmp_path / "adapter")  # already composed with the same config
    torch.testing.assert_close(_logits(composed, ids), _logits(model, ids), rtol=0, atol=0)


def test_adapter_misfits_are_refused(tmp_path):
    sa.save_adapter(_calibrated(), tmp_path / "adapter")
    unmapped = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK))
    with pytest.raises(ValueError, match="model: expected a model composed with the adapter's configs"):
        sa.load_adapter(unmapped, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.self_attn.sieve_sfa.feature_map"
    save_file({**tensors, name: torch.zeros(KV_HEADS, HEAD_DIM, HEAD_DIM // 2)}, str(path))
    with pytest.raises(ValueError, match=f"adapter tensor {name}: expected shape \\(2, 16, 16\\), got \\(2, 16, 8\\)"):
        sa.load_adapter(tiny_model("llama"), tmp_path / "adapter")
    save_file({k: v for k, v in tensors.items() if k != name}, str(path))
    with pytest.raises(ValueError, match="adapter: expected the 2 tensors named as this model's"):
        sa.load_adapter(tiny_model("llama"), tmp_path / "adapter")
    # An adapter without maps into a model composed with them: refused the same way.
    sa.save_adapter(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK)), tmp_path / "unmapped")
    with pytest.raises(ValueError, match="model: expected a model composed with the adapter's configs"):
        sa.load_adapter(_mapped(), tmp_path / "unmapped")


def test_misuse_is_refused():
    windows = _calibration_windows()
    for model, what in ((tiny_model("llama"), "a model without SFA"),
                        (sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK)),
                         "SFA layers with neither a feature map nor selection weights"),
                        (sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4)),
                         "a model without SFA")):
        with pytest.raises(ValueError, match=f"model: expected a model composed with SFAConfig\\(feature_map=True\\) "
                                             f"or SFAConfig\\(selection='importance'\\), got {what}"):
            sa.calibrate_feature_maps(model, windows, progress=False)
    for bad in (torch.zeros(0, 8, dtype=torch.long), windows[0], windows.float()):
        with pytest.raises(ValueError, match="windows: expected token ids"):
            sa.calibrate_feature_maps(_mapped(), bad, progress=False)
    with pytest.raises(ValueError, match="windows: expected a tensor of token ids \\[N >= 1, T\\], got list"):
        sa.calibrate_feature_maps(_mapped(), list(windows), progress=False)
    with pytest.raises(ValueError, match="batch_size: expected an int in \\[1"):
        sa.calibrate_feature_maps(_mapped(), windows, batch_size=0, progress=False)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="feature_map: expected True or False"):
            sa.SFAConfig(feature_map=bad)
    with pytest.raises(ValueError, match="selection: expected one of \\['importance', 'magnitude'\\], got 'weighted'"):
        sa.SFAConfig(selection="weighted")
    config = sa.SFAConfig(topk=TOPK, feature_map=True, selection="importance")
    assert sa.SFAConfig.from_dict(config.to_dict()) == config
    # An adapter saved before selection existed reads as the paper's rule.
    assert sa.SFAConfig.from_dict({"topk": TOPK, "backend": "auto", "feature_map": True}).selection == "magnitude"


def test_maps_stay_float32_in_a_bfloat16_model():
    """The map is stored in float32 (its calibrated axes orthogonal to float32 precision) and cast at use."""
    model = sa.compose(tiny_model("llama").to(torch.bfloat16), sa.SFAConfig(topk=TOPK, feature_map=True))
    sa.calibrate_feature_maps(model, _calibration_windows(), progress=False)
    for layer in sfa_layers(model):
        eye = torch.eye(HEAD_DIM).expand_as(layer.feature_map)
        assert layer.feature_map.dtype == torch.float32
        torch.testing.assert_close(layer.feature_map.transpose(1, 2) @ layer.feature_map, eye, rtol=0, atol=1e-5)
    assert _logits(model, random_ids(2, 12)).dtype == torch.bfloat16


def test_finetune_trains_the_maps_and_writes_them_to_the_adapter_only(tmp_path):
    """The maps are trained; model.safetensors holds only the model's own weights, which load into a fresh
    composed model; with the adapter as well the fresh model computes the fine-tuned one's logits."""
    model = _calibrated()
    before = _maps(model)
    settings = FinetuneSettings(steps=3, lr=3e-3, warmup=1, batch_size=2)
    result = finetune(model, random_ids(6, 24, seed=5), tmp_path / "run", settings, progress=False)
    assert not any(p.requires_grad for p in model.parameters())
    for old, new in zip(before, _maps(model)):
        assert (new - old).abs().max() > 1e-4
    weights = load_file(result["weights"])
    assert weights and not [name for name in weights if ".sieve_sfa." in name]
    assert set(weights) == {name for name in model.state_dict() if ".sieve_sfa." not in name} & set(weights)
    fresh = _mapped()
    load_weights(fresh, result["weights"])
    for name, tensor in weights.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    sa.save_adapter(model, tmp_path / "adapter")
    sa.load_adapter(fresh, tmp_path / "adapter")
    ids = random_ids()
    torch.testing.assert_close(_logits(fresh, ids), _logits(model, ids), rtol=0, atol=1e-6)


def test_resume_restores_the_maps(tmp_path):
    """A run checkpointed after step 2 and resumed in a fresh model with identity maps ends with the maps (and the
    weights) of the uninterrupted run: the checkpoint carries them."""
    settings = FinetuneSettings(steps=4, lr=3e-3, warmup=1, checkpoint_every=2, batch_size=2)
    windows = random_ids(8, 24, seed=5)
    whole = _calibrated()
    finetune(whole, windows, tmp_path / "whole", settings, progress=False)
    parted = _calibrated()
    finetune(parted, windows, tmp_path / "parted", FinetuneSettings(**{**settings.__dict__, "steps": 2}),
             progress=False)
    resumed = _mapped()
    finetune(resumed, windows, tmp_path / "parted", settings, resume=True, progress=False)
    names = [name for name, _ in whole.named_parameters()]
    assert sum(".sieve_sfa.feature_map" in name for name in names) == 2
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
