"""Fine-tuning: SFA conversion with the output-matching term, the plain dense baseline, checkpoints and weights."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import sieve_attn as sa
from sieve_attn.integrations.transformers import sfa_layers
from sieve_attn.train.finetune import FinetuneSettings, finetune, load_weights
from sieve_attn.train.loop import ResumeRefused

try:
    from tests.models import random_ids, threads, tiny_model
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import random_ids, threads, tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with threads(1):
        yield


def _windows():
    return random_ids(6, 24, seed=5)


def _sfa_history(tmp_path, weight: float):
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    settings = FinetuneSettings(steps=12, lr=3e-3, warmup=2, batch_size=2, matching_weight=weight)
    history = finetune(model, _windows(), tmp_path / str(weight), settings, progress=False)["history"]
    assert not any(p.requires_grad for p in model.parameters())  # frozen again afterwards
    return history


def test_sfa_conversion_lowers_the_loss_and_the_matching_weight_pulls_towards_dense(tmp_path):
    free, matched = _sfa_history(tmp_path, 0.0), _sfa_history(tmp_path, 50.0)
    assert [h[2] for h in free] == [None] * 12 and all(h[2] is not None for h in matched)
    assert free[-1][1] < free[0][1] and matched[-1][1] < matched[0][1]
    assert matched[-1][2] < matched[0][2]  # the term it optimises falls


def test_dense_baseline_has_no_matching_term(tmp_path):
    result = finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(steps=3, warmup=1),
                      progress=False)
    assert [h[2:] for h in result["history"]] == [(None, None, None)] * 3


def test_resume_equals_an_uninterrupted_run_and_weights_reload(tmp_path):
    settings = FinetuneSettings(steps=4, lr=3e-3, warmup=1, checkpoint_every=2, batch_size=2)
    whole = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    finetune(whole, _windows(), tmp_path / "whole", settings, progress=False)
    parted = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    finetune(parted, _windows(), tmp_path / "parted", FinetuneSettings(**{**settings.__dict__, "steps": 2}),
             progress=False)
    resumed = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    result = finetune(resumed, _windows(), tmp_path / "parted", settings, resume=True, progress=False)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    fresh = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    load_weights(fresh, result["weights"])
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, whole(ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="weights: expected the"):
        load_weights(tiny_model("gpt2"), result["weights"])


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="matching_weight: expected a finite number >= 0"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(matching_weight=-1))
    with pytest.raises(ValueError, match="windows: expected token ids"):
        finetune(tiny_model("llama"), _windows()[0], tmp_path)
    with pytest.raises(ValueError, match="topk_warmup: expected an int in \\[0"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(topk_warmup=-1))


def test_topk_warmup_schedule():
    """Geometric from the head dim to top-k: 64 -> 32 -> 16 over 2 steps of a warm-up of 2 (k/D = 1/4)."""
    from sieve_attn.train.finetune import topk_at

    assert [topk_at(step, 16, 64, 2) for step in range(4)] == [64, 32, 16, 16]
    assert [topk_at(step, 4, 16, 0) for step in range(2)] == [4, 4]
    assert all(4 <= topk_at(step, 4, 16, 7) <= 16 for step in range(9))


def test_topk_warmup_sparsifies_step_by_step_and_resumes_the_schedule(tmp_path):
    """Each step's forward sees the scheduled top-k (16 coordinates of the tiny model, to 4 over 2 steps); the
    layers end at the configured top-k; a run resumed after step 1 repeats the uninterrupted one."""
    from sieve_attn.integrations.transformers import sfa_layers

    settings = FinetuneSettings(steps=4, lr=3e-3, warmup=1, batch_size=2, topk_warmup=2, checkpoint_every=1)
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    seen = []
    layer = next(iter(sfa_layers(model)))
    attend = layer.attend
    layer.attend = lambda *args, **kwargs: seen.append(layer.topk) or attend(*args, **kwargs)
    whole = finetune(model, _windows(), tmp_path / "whole", settings, progress=False)["history"]
    assert seen == [16, 8, 4, 4] and layer.topk == 4  # one forward per step

    resumed_model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    finetune(resumed_model, _windows(), tmp_path / "part", FinetuneSettings(**{**settings.__dict__, "steps": 1}),
             progress=False)
    resumed = finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path / "part",
                       settings, resume=True, progress=False)["history"]
    assert [row[1] for row in resumed] == pytest.approx([row[1] for row in whole], rel=1e-5)


def test_activation_checkpointing_trains_the_same_weights_and_writes_the_same_names(tmp_path):
    """Recomputing each layer in backward (as FSDP's activation checkpointing does) runs the SFA layers again, which
    records their matching terms again: they must not leak into the next step. The wrapper's module name must not
    reach the files."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plain, wrapped = (sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)) for _ in range(2))
    apply_activation_checkpointing(wrapped, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    # Warm-up over every step, so that the 3-step run can be resumed as a 4-step one (loop._check_length).
    settings = FinetuneSettings(steps=3, lr=3e-3, warmup=4, batch_size=2, checkpoint_every=2)
    a = finetune(plain, _windows(), tmp_path / "plain", settings, progress=False)
    b = finetune(wrapped, _windows(), tmp_path / "wrapped", settings, progress=False)
    flat = [[value for row in run["history"] for value in row[1:] if value is not None] for run in (a, b)]
    assert flat[1] == pytest.approx(flat[0], abs=1e-6, rel=0)
    assert [[v is None for v in row] for row in a["history"]] == [[v is None for v in row] for row in b["history"]]
    ta, tb = load_file(a["weights"]), load_file(b["weights"])
    assert list(ta) == list(tb)
    for name in ta:
        torch.testing.assert_close(tb[name], ta[name], rtol=0, atol=1e-6, msg=name)
    # The wrapped model resumes from the plain one's checkpoint: the same names, in the same order.
    resumed = sa.compose(tiny_model("llama", seed=5), sa.SFAConfig(topk=4))
    apply_activation_checkpointing(resumed, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    c = finetune(resumed, _windows(), tmp_path / "plain", FinetuneSettings(**{**settings.__dict__, "steps": 4}),
                 resume=True, progress=False)
    assert c["history"][:3] == a["history"] and len(c["history"]) == 4


def test_micro_batches_give_the_gradients_of_the_whole_batch():
    """One SFA fine-tuning step (matching, distillation and residual-energy terms on) over 4 windows as 2
    micro-batches of 2: the same LM loss, matching, distillation and residual-energy terms and weight gradients (not a multiple of them) as over the whole
    batch, to float rounding."""
    from sieve_attn.integrations.transformers import sfa_layers
    from sieve_attn.train import finetune as finetune_module
    from sieve_attn.train.distributed import Runtime

    class KeepGrads:
        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=True)

        def step(self):
            pass

    teacher = tiny_model("llama", seed=3).requires_grad_(False)
    results = []
    for parts in (1, 2):
        model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
        model.eval()
        params = list(finetune_module.trained_parameters(model).values())
        for p in params:
            p.requires_grad_(True)
        layers = list(sfa_layers(model))
        for layer in layers:
            layer.matching = layer.sparsity = True
        objective = finetune_module.Objective(layers, 1.0, teacher, 0.5, sparsity_weight=0.3)
        values = finetune_module._train_step(model, params, KeepGrads(), objective, Runtime(),
                                             _windows()[:4].split(4 // parts))
        results.append((values, [p.grad.clone() for p in params]))
    (whole_values, whole_grads), (micro_values, micro_grads) = results
    assert micro_values == pytest.approx(whole_values, rel=1e-6)
    for whole, micro in zip(whole_grads, micro_grads):
        torch.testing.assert_close(micro, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["sfa", "sfa-mapped", "dense"])
def test_bf16_mixed_precision_runs_the_forwards_in_bfloat16_and_keeps_float32_weights(tmp_path, method):
    """mixed_precision="bf16": the attention projections' outputs are bfloat16 during training (autocast is on),
    the loss is close to the float32 one but not equal to it, and the weights (SFA feature maps too), gradients and
    the returned model stay float32; validation runs in float32. (transformers' RoPE returns float32 q and k under
    autocast beside a bfloat16 v: SFA without a feature map must take them.)"""
    from sieve_attn.train import finetune as finetune_module
    from sieve_attn.train.distributed import Runtime

    def model_of():
        model = tiny_model("llama")
        return model if method == "dense" else sa.compose(model, sa.SFAConfig(topk=4, feature_map="mapped" in method))

    losses, dtypes = [], []
    for autocast_dtype in (None, torch.bfloat16):
        model = model_of().eval()
        params = finetune_module.trained_parameters(model)
        for p in params.values():
            p.requires_grad_(True)
        hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda module, inputs, output: dtypes.append(output.dtype))
        optimizer = torch.optim.SGD(params.values(), lr=0.0)
        objective = finetune_module.Objective([], autocast_dtype=autocast_dtype)
        loss, *_ = finetune_module._train_step(model, list(params.values()), optimizer, objective, Runtime(),
                                               _windows()[:2].split(2))
        hook.remove()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params.values())
        losses.append(float(loss))
    assert dtypes == [torch.float32, torch.bfloat16]
    assert losses[0] != losses[1] and losses[1] == pytest.approx(losses[0], rel=2e-2)

    model = model_of()
    seen = []  # (dtype of the projection's output, whether autograd records): training steps, then validation
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda module, inputs, output: seen.append((output.dtype, torch.is_grad_enabled())))
    settings = FinetuneSettings(steps=3, lr=3e-3, warmup=1, batch_size=2, mixed_precision="bf16", validate_every=3)
    result = finetune(model, _windows(), tmp_path, settings, validation=_windows()[:2], progress=False)
    assert seen[:3] == [(torch.bfloat16, True)] * 3  # a forward per step
    assert len(seen) > 3 and set(seen[3:]) == {(torch.float32, False)}  # the validation's forwards
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert result["history"][-1][1] < result["history"][0][1]
    with pytest.raises(ValueError, match="mixed_precision: expected one of \\['bf16', 'no'\\], got 'fp16'"):
        finetune(model_of(), _windows(), tmp_path / "bad", FinetuneSettings(mixed_precision="fp16"))


def test_distillation_loss_is_the_kl_divergence_from_the_teacher_per_token():
    from sieve_attn.train.finetune import distillation_loss

    generator = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(2, 3, 7, generator=generator, dtype=torch.float64) for _ in range(2))
    p, q = teacher.softmax(-1), student.softmax(-1)
    want = (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(distillation_loss(student, teacher).double(), want, rtol=1e-5, atol=1e-7)
    assert distillation_loss(teacher, teacher) == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(student.bfloat16(), teacher.bfloat16()).dtype == torch.float32


def test_distillation_pulls_the_student_to_a_frozen_teacher(tmp_path):
    """A dense model distilling from its own copy starts with a zero term; an SFA student's term falls while the
    teacher stays as it was; and the run's history records the term."""
    settings = FinetuneSettings(steps=12, lr=1e-2, warmup=1, batch_size=2, matching_weight=0.0, distill_weight=20.0)
    copy = tiny_model("llama")
    history = finetune(tiny_model("llama"), _windows(), tmp_path / "self", settings, teacher=copy,
                       progress=False)["history"]
    assert history[0][3] == pytest.approx(0.0, abs=1e-6) and history[0][2] is None

    teacher = tiny_model("llama", seed=3)
    before = {name: p.clone() for name, p in teacher.named_parameters()}
    student = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    history = finetune(student, _windows(), tmp_path / "sfa", settings, teacher=teacher, progress=False)["history"]
    assert history[-1][3] < 0.5 * history[0][3]
    assert all(torch.equal(p, before[name]) for name, p in teacher.named_parameters())
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())  # no graph through it


def test_history_rows_of_an_older_checkpoint_gain_the_later_terms_values():
    from sieve_attn.train.finetune import _padded

    assert _padded([(1, 2.5, None), (2, 2.0, 0.1, None)]) == [(1, 2.5, None, None, None), (2, 2.0, 0.1, None, None)]


def test_residual_energy_term_shrinks_the_energy_the_topk_drops(tmp_path):
    """With --sparsity-weight the history records the residual-energy term (the 5th value) and a heavy weight
    makes it fall; without, it is None; only the matching term's layers' flags are on during the run."""
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    settings = FinetuneSettings(steps=12, lr=3e-3, warmup=2, batch_size=2, matching_weight=0.0,
                                sparsity_weight=50.0)
    history = finetune(model, _windows(), tmp_path / "sparse", settings, progress=False)["history"]
    assert all(h[2] is None and 0 < h[4] < 1 for h in history)
    assert history[-1][4] < 0.8 * history[0][4]
    layers = list(sfa_layers(model))
    assert not any(layer.sparsity or layer.matching or layer.sparsity_terms for layer in layers)
    plain = finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path / "plain",
                     FinetuneSettings(steps=2, warmup=1, batch_size=2), progress=False)["history"]
    assert [h[4] for h in plain] == [None, None] and all(h[2] is not None for h in plain)
    with pytest.raises(ValueError, match="sparsity_weight: expected a finite number >= 0, got -1"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(sparsity_weight=-1))


def test_distillation_needs_a_teacher_of_the_same_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="teacher: expected a model exactly when distill_weight > 0, got none"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(distill_weight=1.0))
    with pytest.raises(ValueError, match="teacher: expected a model exactly when distill_weight > 0, got a model"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(), teacher=tiny_model("llama"))
    with pytest.raises(ValueError, match="distill_weight: expected a finite number >= 0, got nan"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(distill_weight=float("nan")))
    other = tiny_model("llama")
    other.resize_token_embeddings(other.config.vocab_size + 8)
    with pytest.raises(ValueError, match="teacher: expected a model of the vocabulary size"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(distill_weight=1.0), teacher=other)


def _scripted_validation(monkeypatch, losses, weights):
    """Replaces the validation by ``losses`` in turn (raising RuntimeError when they run out: a crash), recording
    the model's parameters at each call in ``weights`` (a list)."""
    import sieve_attn.train.finetune as finetune_module

    losses = iter(losses)

    def scripted(model, windows, layers):
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
        loss = next(losses, None)
        if loss is None:
            raise RuntimeError("crash")
        return loss

    monkeypatch.setattr(finetune_module, "_validate", scripted)


def _assert_weights(model, weights):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, weights[name], rtol=0, atol=0, msg=name)


def test_early_stopping_ends_with_the_weights_of_the_best_validation(tmp_path, monkeypatch):
    """Validation every 2 steps and after the last (step 5): the model ends with the weights it had at the lowest
    validation loss (step 4 here, scripted), which model.safetensors and the one best file left hold too."""
    seen = []
    _scripted_validation(monkeypatch, [3.0, 1.0, 2.0], seen)
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    settings = FinetuneSettings(steps=5, lr=3e-3, warmup=1, batch_size=2, validate_every=2)
    result = finetune(model, _windows(), tmp_path, settings, validation=random_ids(2, 24, seed=9), progress=False)
    assert result["validations"] == [(2, 3.0), (4, 1.0), (5, 2.0)] and result["best_step"] == 4
    _assert_weights(model, seen[1])
    assert [p.name for p in tmp_path.glob("best-*")] == ["best-4.safetensors"]  # step 2's went at the last checkpoint
    best, final = load_file(str(tmp_path / "best-4.safetensors")), load_file(result["weights"])
    assert list(best) == list(final) and all(torch.equal(best[name], final[name]) for name in best)
    assert not torch.equal(seen[1]["model.norm.weight"], seen[0]["model.norm.weight"])  # the steps did train


def test_a_best_written_after_the_last_checkpoint_does_not_survive_a_crash(tmp_path, monkeypatch):
    """Checkpoints at steps 2 and 4; the best of step 3 is written, then the run crashes at step 4's validation. The
    resumed run replays step 3 with a worse loss (validations are not bit-reproducible on every device): it must end
    with step 2's weights, the best its checkpoint names, not with the stale file of step 3."""
    settings = FinetuneSettings(steps=6, lr=3e-3, warmup=1, batch_size=2, checkpoint_every=2, validate_every=1)
    validation = random_ids(2, 24, seed=9)
    first = []
    _scripted_validation(monkeypatch, [5.0, 4.0, 3.0], first)
    with pytest.raises(RuntimeError, match="crash"):
        finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings,
                 validation=validation, progress=False)
    assert sorted(p.name for p in tmp_path.glob("best-*")) == ["best-2.safetensors", "best-3.safetensors"]
    _scripted_validation(monkeypatch, [4.5, 4.2, 4.1, 4.05], [])
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    result = finetune(model, _windows(), tmp_path, settings, validation=validation, resume=True, progress=False)
    assert result["best_step"] == 2 and [s for s, _ in result["validations"]] == [1, 2, 3, 4, 5, 6]
    _assert_weights(model, first[1])
    assert [p.name for p in tmp_path.glob("best-*")] == ["best-2.safetensors"]


@pytest.mark.parametrize("change, message", [
    ({"lr": 1e-3}, "lr: expected 0.003, the value in .*checkpoint.pt .*got 0.001"),
    ({"mixed_precision": "bf16"}, "mixed_precision: expected 'no', the value in"),
    ({"matching_weight": 0.0}, "matching_weight: expected 1.0, the value in"),
    ({"seed": 1}, "seed: expected 0, the value in"),
])
def test_resume_refuses_settings_that_change_the_run(tmp_path, change, message):
    """Resuming may extend a run (steps) but not change what it trains towards; the refusal comes before the
    checkpoint is restored, so the model is untouched."""
    settings = FinetuneSettings(steps=1, lr=3e-3, warmup=1, batch_size=2)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings, progress=False)
    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        finetune(model, _windows(), tmp_path, FinetuneSettings(**{**settings.__dict__, "steps": 2, **change}),
                 resume=True, progress=False)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_resume_refuses_a_model_composed_otherwise(tmp_path):
    settings = FinetuneSettings(steps=1, lr=3e-3, warmup=1, batch_size=2)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings, progress=False)
    with pytest.raises(ValueError, match="model: expected \\{.*'topk': 4.*\\}, what .*checkpoint.pt was trained "
                                         "with, got .*'topk': 8"):
        finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=8)), _windows(), tmp_path,
                 FinetuneSettings(**{**settings.__dict__, "steps": 2}), resume=True, progress=False)


def test_resume_refuses_another_teacher(tmp_path):
    """A distillation resumes with the same teacher weights (a fresh copy of them is fine), not with others."""
    settings = FinetuneSettings(steps=1, lr=3e-3, warmup=1, batch_size=2, distill_weight=1.0)
    finetune(tiny_model("llama"), _windows(), tmp_path, settings, teacher=tiny_model("llama", seed=3),
             progress=False)
    longer = FinetuneSettings(**{**settings.__dict__, "steps": 2})
    finetune(tiny_model("llama"), _windows(), tmp_path, longer, teacher=tiny_model("llama", seed=3), resume=True,
             progress=False)
    with pytest.raises(ValueError, match="teacher: expected 'sha256:[0-9a-f]{16}', what .*checkpoint.pt was trained "
                                         "with, got 'sha256:[0-9a-f]{16}'"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(**{**settings.__dict__, "steps": 3}),
                 teacher=tiny_model("llama", seed=4), resume=True, progress=False)


def test_resume_refuses_another_start(tmp_path):
    """A run started from other weights (sieve finetune --init) resumes only with the same ones."""
    settings = FinetuneSettings(steps=1, lr=3e-3, warmup=1, batch_size=2)
    finetune(tiny_model("llama"), _windows(), tmp_path, settings, init="sha256:0123456789abcdef", progress=False)
    with pytest.raises(ValueError, match="init: expected 'sha256:0123456789abcdef', what .*checkpoint.pt was "
                                         "trained with, got None"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(**{**settings.__dict__, "steps": 2}),
                 resume=True, progress=False)


def test_resume_refuses_other_windows(tmp_path):
    settings = FinetuneSettings(steps=1, lr=3e-3, warmup=1, batch_size=2)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings, progress=False)
    with pytest.raises(ValueError, match="windows: expected the token windows .* trained on \\(6 x 24 sha256:"
                                         ".*got 6 x 24 sha256:"):
        finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), random_ids(6, 24, seed=6), tmp_path,
                 FinetuneSettings(**{**settings.__dict__, "steps": 2}), resume=True, progress=False)


def test_resume_refuses_another_models_checkpoint_before_loading_it(tmp_path):
    """Another model of the same tokenizer and configs (here a wider MLP) trains on the same windows: its
    checkpoint is refused by the trained tensors' layout, not failed on halfway through loading."""
    settings = FinetuneSettings(steps=1, lr=3e-3, warmup=1, batch_size=2)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings, progress=False)
    wider = sa.compose(tiny_model("llama", intermediate_size=192), sa.SFAConfig(topk=4))
    with pytest.raises(ResumeRefused, match="^base: expected 'sha256:.*', what .* was trained with, got 'sha256:"):
        finetune(wider, _windows(), tmp_path, FinetuneSettings(**{**settings.__dict__, "steps": 2}), resume=True,
                 progress=False)


def test_resume_without_validation_keeps_the_last_weights_and_the_best_files(tmp_path, monkeypatch):
    _scripted_validation(monkeypatch, [1.0, 2.0], [])
    settings = FinetuneSettings(steps=2, lr=3e-3, warmup=1, batch_size=2, validate_every=1)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings,
             validation=random_ids(2, 24, seed=9), progress=False)
    plain = FinetuneSettings(**{**settings.__dict__, "steps": 4, "validate_every": 0})
    result = finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, plain,
                      resume=True, progress=False)
    assert result["best_step"] is None and result["validations"] == []
    assert (tmp_path / "best-1.safetensors").is_file()
    last, best = load_file(result["weights"]), load_file(str(tmp_path / "best-1.safetensors"))
    assert not torch.equal(last["model.norm.weight"], best["model.norm.weight"])


def test_resume_refuses_a_checkpoint_without_its_best_weights(tmp_path, monkeypatch):
    _scripted_validation(monkeypatch, [1.0, 2.0, 3.0], [])
    settings = FinetuneSettings(steps=2, lr=3e-3, warmup=1, batch_size=2, validate_every=1)
    validation = random_ids(2, 24, seed=9)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings,
             validation=validation, progress=False)
    (tmp_path / "best-1.safetensors").unlink()
    with pytest.raises(ValueError, match="checkpoint: expected best-1.safetensors beside it"):
        finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path,
                 FinetuneSettings(**{**settings.__dict__, "steps": 3}), validation=validation, resume=True,
                 progress=False)


def test_nan_validations_are_never_the_best():
    from sieve_attn.train.loop import best_validation, is_new_best

    nan = float("nan")
    assert not is_new_best(nan, []) and is_new_best(2.0, [(1, nan)]) and not is_new_best(2.0, [(1, 2.0)])
    assert best_validation([(1, nan), (2, 3.0), (3, 1.0), (4, 1.0), (5, nan)]) == (3, 1.0)
    assert best_validation([(1, nan)]) is None and best_validation([]) is None


def test_validated_run_resumes_like_an_uninterrupted_one(tmp_path):
    """Real validations (SFA at its configured top-k during a top-k warm-up): a run resumed after step 2 ends with
    the same validations, best step and weights as an uninterrupted one."""
    settings = FinetuneSettings(steps=4, lr=3e-2, warmup=1, batch_size=2, checkpoint_every=2, validate_every=1,
                                topk_warmup=2)
    validation = random_ids(2, 24, seed=9)
    whole_model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    whole = finetune(whole_model, _windows(), tmp_path / "whole", settings, validation=validation, progress=False)
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path / "part",
             FinetuneSettings(**{**settings.__dict__, "steps": 2}), validation=validation, progress=False)
    resumed_model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    resumed = finetune(resumed_model, _windows(), tmp_path / "part", settings, validation=validation, resume=True,
                       progress=False)
    assert [s for s, _ in resumed["validations"]] == [1, 2, 3, 4] and resumed["best_step"] == whole["best_step"]
    assert [v for _, v in resumed["validations"]] == pytest.approx([v for _, v in whole["validations"]], rel=1e-5)
    for (name, a), b in zip(whole_model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_resume_refuses_other_validation_windows_and_finishes_the_cleanup_a_crash_cut_short(tmp_path):
    """Validations on other windows would choose the best weights across two sets: refused. A crash between the
    last checkpoint and the deletion of superseded best weights leaves one behind; resuming (with no step left)
    deletes it."""
    settings = FinetuneSettings(steps=2, lr=3e-2, warmup=1, batch_size=2, checkpoint_every=1, validate_every=1)
    validation = random_ids(2, 24, seed=9)
    done = finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings,
                    validation=validation, progress=False)
    with pytest.raises(ValueError, match="validation: expected '2 x 24 sha256:"):
        finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings,
                 validation=random_ids(2, 24, seed=10), resume=True, progress=False)
    kept = f"best-{done['best_step']}.safetensors"
    superseded = tmp_path / ("best-1.safetensors" if kept != "best-1.safetensors" else "best-2.safetensors")
    superseded.write_bytes((tmp_path / kept).read_bytes())
    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path, settings,
             validation=validation, resume=True, progress=False)
    assert sorted(p.name for p in tmp_path.glob("best-*")) == [kept]


def test_validation_scores_sfa_at_its_configured_topk_without_matching_terms():
    """Mid warm-up (the layers at top-k 16, recording matching terms), a validation scores the model at its
    configured top-k, records no matching term, and leaves the layers as they were."""
    from sieve_attn.eval.perplexity import perplexity
    from sieve_attn.integrations.transformers import sfa_layers
    from sieve_attn.train.finetune import _validate

    model = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    windows = random_ids(2, 24, seed=9)
    layers = list(sfa_layers(model))
    want = perplexity(model, windows, progress=False)["nll"]  # at the configured top-k 4
    for layer in layers:
        layer.topk, layer.matching = 16, True
    model.requires_grad_(True)
    assert _validate(model, windows, layers) == pytest.approx(want, rel=1e-6)
    assert all(layer.topk == 16 and layer.matching and not layer.matching_terms for layer in layers)


def test_validation_is_refused_without_windows_and_by_a_job_without_validation(tmp_path):
    from sieve_attn.train.retrofit import RetrofitSettings, retrofit

    with pytest.raises(ValueError, match="validation: expected token ids \\[M >= 1, 24\\]"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(validate_every=2))
    with pytest.raises(ValueError, match="validation: expected"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(validate_every=2),
                 validation=random_ids(2, 12))
    with pytest.raises(ValueError, match="validate_every: expected an int in \\[0"):
        finetune(tiny_model("llama"), _windows(), tmp_path, FinetuneSettings(validate_every=-1))
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=2, window=4))
    with pytest.raises(ValueError, match="validate_every: expected 0 for retrofit without validation data"):
        retrofit(model, _windows(), tmp_path / "r", RetrofitSettings(steps=1, validate_every=1), progress=False)


def test_hold_back_takes_the_last_files_for_validation(tmp_path):
    from sieve_attn.data.text import hold_back

    class Chars:  # one token per character
        eos_token_id = 0

        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    files = []
    for name, size in (("a", 40), ("b", 30), ("c", 9), ("d", 9)):
        files.append(tmp_path / name)
        files[-1].write_text("x" * size)
    train, validation = hold_back(Chars(), files, context=8, windows=2)  # c and d: 2 x (9 + 1 EOS) tokens
    assert train == files[:2] and validation.shape == (2, 8)
    train, _ = hold_back(Chars(), files, context=8, windows=3)
    assert train == files[:1]
    with pytest.raises(ValueError, match="validation_windows: expected fewer windows"):
        hold_back(Chars(), files, context=8, windows=11)
    Chars.eos_token_id = None  # no separator token: files hold only their own tokens
    train, _ = hold_back(Chars(), files, context=8, windows=2)  # d alone (9 tokens) fills 1 window, c too
    assert train == files[:2]
    train, _ = hold_back(Chars(), files, context=8, windows=3)  # 27 tokens need b as well (9 + 9 = 18 < 24)
    assert train == files[:1]
    with pytest.raises(ValueError, match="validation_windows: expected an int in \\[1"):
        hold_back(Chars(), files, context=8, windows=0)
