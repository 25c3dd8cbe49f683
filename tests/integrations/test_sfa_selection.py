"""SFA's importance selection: calibrated weights rank each coordinate by the share of a typical score it carries;
every attention path, the compressed cache, adapters and fine-tuning checkpoints carry them."""
from __future__ import annotations

import pytest
import torch

import sieve_attn as sa
from sieve_attn.eval.generate import greedy_recompute
from sieve_attn.integrations.transformers import adapter_state, sfa_layers
from sieve_attn.nn.sfa_layer import Moments, SFALayer
from sieve_attn.ops.sfa.codes import sparsify
from sieve_attn.train.calibrate import _calibrated as calibrated_layer
from sieve_attn.train.finetune import FinetuneSettings, finetune

try:
    from tests.integrations.test_sfa_cache import _generate, _step_logits
    from tests.integrations.test_sfa_compose import _logits, _one_thread  # noqa: F401 (an autouse fixture)
    from tests.models import random_ids, skip_without_cpu_kernels, tiny_model
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from integrations.test_sfa_cache import _generate, _step_logits
    from integrations.test_sfa_compose import _logits, _one_thread  # noqa: F401 (an autouse fixture)
    from models import random_ids, skip_without_cpu_kernels, tiny_model

HEAD_DIM, TOPK, KV_HEADS = 16, 4, 2  # the tiny llama: 4 query heads, 2 KV heads of dim 16
PROMPT = 20


def _config(feature_map: bool = True, **overrides) -> sa.SFAConfig:
    return sa.SFAConfig(topk=TOPK, feature_map=feature_map, selection="importance", **overrides)


def _calibrated(feature_map: bool = True, arch: str = "llama", **overrides):
    model = sa.compose(tiny_model(arch), _config(feature_map, **overrides))
    return sa.calibrate_feature_maps(model, random_ids(4, 24, seed=3), progress=False)


def _weights(model) -> list[torch.Tensor]:
    return [layer.selection_weights.clone() for layer in sfa_layers(model)]


@pytest.mark.parametrize("feature_map", [True, False])
def test_calibrated_weights_are_each_partners_root_mean_square(feature_map):
    """From the moments of given q and k (4 query heads on 2 KV heads), the query weights of KV head g are the
    root mean square of its keys along each coordinate of the calibrated basis, and the key weights that of its
    query heads' queries (heads 2g and 2g + 1); without a map the basis is the identity."""
    layer = SFALayer(_config(feature_map, backend="reference"), KV_HEADS, HEAD_DIM)
    generator = torch.Generator().manual_seed(4)
    scales = torch.linspace(0.1, 3.0, HEAD_DIM)
    q = torch.randn(2, 4, 9, HEAD_DIM, generator=generator) * scales
    k = torch.randn(2, KV_HEADS, 9, HEAD_DIM, generator=generator) * scales.flip(0)
    v = torch.randn(2, KV_HEADS, 9, HEAD_DIM, generator=generator)
    layer.moments, layer.topk = Moments(), HEAD_DIM
    with torch.no_grad():
        layer.attend(q, k, v)
    axes, weights = calibrated_layer(layer)
    assert weights.shape == (2, KV_HEADS, HEAD_DIM)
    if not feature_map:
        assert torch.equal(axes, torch.eye(HEAD_DIM).expand(KV_HEADS, -1, -1))
    for g in range(KV_HEADS):
        keys = k[:, g].reshape(-1, HEAD_DIM) @ axes[g]
        queries = q[:, 2 * g:2 * g + 2].reshape(-1, HEAD_DIM) @ axes[g]
        torch.testing.assert_close(weights[0, g], keys.pow(2).mean(0).sqrt(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(weights[1, g], queries.pow(2).mean(0).sqrt(), rtol=1e-4, atol=1e-6)


def test_queries_rank_by_their_kv_heads_query_weights_and_keys_by_the_key_weights():
    """GQA, 4 query heads on 2 KV heads: query head h is mapped by KV head g = h // 2's map and ranked by its query
    weights [0, g]; keys by their own head's map and key weights [1, g]; an explicit loop is the reference."""
    model = _calibrated()
    layer = next(iter(sfa_layers(model)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.selection_weights.copy_(torch.rand(2, KV_HEADS, HEAD_DIM, generator=generator))
    q = torch.randn(2, 4, 5, HEAD_DIM, generator=generator)
    k = torch.randn(2, KV_HEADS, 5, HEAD_DIM, generator=generator)
    m, w = layer.feature_map.detach(), layer.selection_weights
    with torch.no_grad():
        mapped_q, mapped_k = layer.map_queries(q), layer.map_keys(k)
    for h in range(4):
        expected = sparsify(q[:, h] @ m[h // 2], TOPK, w[0, h // 2])
        torch.testing.assert_close(mapped_q[:, h], expected, rtol=0, atol=1e-6)
    for g in range(KV_HEADS):
        expected = sparsify(k[:, g] @ m[g], TOPK, w[1, g])
        torch.testing.assert_close(mapped_k[:, g], expected, rtol=0, atol=1e-6)


def test_importance_keeps_the_scores_that_magnitude_drops():
    """Queries large along 4 coordinates where the keys are nearly 0, and moderate along 4 that both share: the
    plain top-4 keeps the large, useless ones and loses the scores; ranked by the keys' spread it keeps the shared
    ones and stays close to dense attention."""
    tokens, generator = 64, torch.Generator().manual_seed(0)
    useless, shared = torch.zeros(HEAD_DIM), torch.zeros(HEAD_DIM)
    useless[:4], shared[4:8] = 1.0, 1.0
    latent = lambda heads: torch.randn(1, heads, tokens, HEAD_DIM, generator=generator)  # noqa: E731
    q = latent(2) * (3.0 * useless + 1.5 * shared + 0.01)
    k = latent(1) * (0.01 * useless + 1.5 * shared + 0.01)
    v = latent(1)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    dense = torch.softmax((q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5).masked_fill(~causal, float("-inf")), -1) @ v
    plain = SFALayer(sa.SFAConfig(topk=TOPK, backend="reference"), 1, HEAD_DIM)
    ranked = SFALayer(_config(False, backend="reference"), 1, HEAD_DIM)
    with torch.no_grad():
        ranked.moments, ranked.topk = Moments(), HEAD_DIM
        ranked.attend(q, k, v)
        ranked.selection_weights.copy_(calibrated_layer(ranked)[1])
        ranked.moments, ranked.topk = None, TOPK
        errors = [(layer.attend(q, k, v) - dense).pow(2).mean().sqrt().item() for layer in (plain, ranked)]
    assert errors[0] > 0.1 and errors[1] < errors[0] / 5


def test_uncalibrated_weights_are_the_plain_rule():
    """Compose starts the weights at 1 (a float32 buffer [2, Hkv, D], not a parameter): the logits are those of
    the plain rule until calibration sets them, after which they differ."""
    ids = random_ids()
    model = sa.compose(tiny_model("llama"), _config(False))
    for layer in sfa_layers(model):
        assert torch.equal(layer.selection_weights, torch.ones(2, KV_HEADS, HEAD_DIM))
    assert not any("selection_weights" in name for name, _ in model.named_parameters())
    plain = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK))
    torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), rtol=0, atol=0)
    sa.calibrate_feature_maps(model, random_ids(4, 24, seed=3), progress=False)
    assert (_logits(model, ids) - _logits(plain, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_every_backend_computes_the_weighted_codes(backend):
    """The layer hands every backend q and k already reduced to their weighted top-k, which each backend's plain
    top-k keeps as they are: the logits equal the reference backend's."""
    if backend == "triton":
        skip_without_cpu_kernels()
    reference = _calibrated(backend="reference")
    other = sa.compose(tiny_model("llama"), _config(backend=backend))
    other.load_state_dict(reference.state_dict())
    ids = random_ids()
    torch.testing.assert_close(_logits(other, ids), _logits(reference, ids), rtol=0, atol=2e-5)


def test_focus_and_sfa_compose_with_importance_selection():
    """Focus's pattern scores the weighted codes: at a window covering the sequence (every pair local) the Focus
    model computes the SFA model's logits."""
    ids = random_ids(2, 12)
    sfa = _calibrated()
    both = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=64, mode="hard"), _config())
    both.load_state_dict(sfa.state_dict(), strict=False)
    torch.testing.assert_close(_logits(both, ids), _logits(sfa, ids), rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_generation_over_the_cache_matches_the_full_forward(arch):
    """The cache codes the weighted keys; decode steps (Llama: sfa_decode with the weighted queries; Gemma-2's
    softcap: densified codes) give the greedy tokens and logits of the full forward."""
    model = _calibrated(arch=arch)
    prompt = random_ids(2, PROMPT, seed=7)
    compressed = _generate(model, prompt, sa.SFACache(model))
    assert torch.equal(compressed.sequences, greedy_recompute(model, prompt, compressed.sequences.shape[1] - PROMPT))
    full = _logits(model, compressed.sequences[:, :-1])[:, PROMPT - 1:]
    torch.testing.assert_close(_step_logits(compressed), full, rtol=0, atol=1e-4)


def test_adapter_round_trip_carries_the_weights(tmp_path):
    model = _calibrated()
    assert sorted(name for name in adapter_state(model) if "selection" in name) == [
        f"model.layers.{i}.self_attn.sieve_sfa.selection_weights" for i in range(2)]
    sa.save_adapter(model, tmp_path / "adapter")
    fresh = sa.load_adapter(tiny_model("llama"), tmp_path / "adapter")
    assert fresh.sieve_sfa_config == _config()
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(fresh)))
    ids = random_ids()
    torch.testing.assert_close(_logits(fresh, ids), _logits(model, ids), rtol=0, atol=0)
    magnitude = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK, feature_map=True))
    with pytest.raises(ValueError, match="model: expected a model composed with the adapter's configs"):
        sa.load_adapter(magnitude, tmp_path / "adapter")


def test_finetune_keeps_the_weights_and_resume_restores_them(tmp_path):
    """Fine-tuning trains the map but not the selection weights; a run resumed in a fresh, uncalibrated model
    takes them from the checkpoint and ends as the uninterrupted run; a checkpoint of a model without them is
    refused."""
    settings = FinetuneSettings(steps=4, lr=3e-3, warmup=1, checkpoint_every=2, batch_size=2)
    windows = random_ids(8, 24, seed=5)
    whole = _calibrated()
    calibrated = _weights(whole)
    finetune(whole, windows, tmp_path / "whole", settings, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(calibrated, _weights(whole)))
    finetune(_calibrated(), windows, tmp_path / "parted", FinetuneSettings(**{**settings.__dict__, "steps": 2}),
             progress=False)
    resumed = sa.compose(tiny_model("llama"), _config())
    finetune(resumed, windows, tmp_path / "parted", settings, resume=True, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(calibrated, _weights(resumed)))
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    magnitude = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=TOPK, feature_map=True))
    finetune(magnitude, windows, tmp_path / "magnitude", FinetuneSettings(**{**settings.__dict__, "steps": 2}),
             progress=False)
    importance = sa.compose(tiny_model("llama"), _config())
    before = {name: p.clone() for name, p in importance.named_parameters()}
    with pytest.raises(ValueError, match="model: expected .*'magnitude'.*what .* was trained with"):
        finetune(importance, windows, tmp_path / "magnitude", settings, resume=True, progress=False)
    # A checkpoint older than the recorded configs: the missing selection weights are refused, before any restore.
    path = tmp_path / "magnitude" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    del state["identity"]
    torch.save(state, path)
    with pytest.raises(ValueError, match="checkpoint: expected the 2 selection weights of this model's SFA layers"):
        finetune(importance, windows, tmp_path / "magnitude", settings, resume=True, progress=False)
    assert all(torch.equal(p, before[name]) for name, p in importance.named_parameters())


def test_adapter_with_bad_selection_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    sa.save_adapter(_calibrated(), tmp_path)
    tensors = load_file(str(tmp_path / "adapter.safetensors"))
    name = "model.layers.1.self_attn.sieve_sfa.selection_weights"
    save_file({**tensors, name: -tensors[name]}, str(tmp_path / "adapter.safetensors"))
    with pytest.raises(ValueError, match=f"adapter tensor {name}: expected finite selection weights >= 0"):
        sa.load_adapter(tiny_model("llama"), tmp_path)
