"""Router-only retrofit of a tiny Llama: frozen weights, checkpoints, resume, and the adapter it writes."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import sieve_attn as sa
from sieve_attn.integrations.transformers import adapter_state, attention_modules
from sieve_attn.nn.router import FocusRouter
from sieve_attn.train.checkpoint import load_checkpoint, save_checkpoint
from sieve_attn.train.retrofit import RetrofitSettings, retrofit

try:
    from tests.models import random_ids, threads, tiny_model
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import random_ids, threads, tiny_model

CONFIG = sa.FocusConfig(num_groups=4, window=4, top_k=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with threads(1):
        yield


def _composed(router_seed: int = 0):
    model = tiny_model("llama", seed=0)
    torch.manual_seed(router_seed)
    return sa.compose(model, CONFIG)


def _windows():
    return random_ids(8, 32, seed=11)


def _router_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters and buffers of every FocusRouter, keyed as in the model's state_dict, found from the module tree."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, FocusRouter):
            found |= {f"{prefix}.{name}": t.detach().clone() for name, t in module.state_dict().items()}
    return found


def _leftovers(folder):
    """Temporary files an atomic write would leave behind (their names start with a dot)."""
    return sorted(p.name for p in folder.rglob(".*"))


def test_retrofit_trains_only_the_routers(tmp_path):
    model = _composed()
    originals = {name: p.detach().clone() for name, p in model.named_parameters() if ".sieve_focus." not in name}
    routers_before = _router_tensors(model)
    assert len(routers_before) == 3 * len(attention_modules(model))  # proj.weight, centroids, group_bias per layer

    result = retrofit(model, _windows(), tmp_path,
                      RetrofitSettings(steps=3, batch_size=2, lr=1e-2, warmup=1, checkpoint_every=10), progress=False)

    assert [step for step, _ in result["history"]] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in result["history"])
    for name, param in model.named_parameters():
        if name in originals:
            assert torch.equal(param, originals[name]), name
            assert not param.requires_grad, name
    routers_after = _router_tensors(model)
    for name, before in routers_before.items():
        assert not torch.equal(routers_after[name], before), f"{name} did not change"
    assert model.sieve_config.mode == CONFIG.mode  # the inference mode comes back after training
    assert not any(m.training for m in model.modules() if isinstance(m, FocusRouter))

    saved = load_file(str(tmp_path / "adapter" / "adapter.safetensors"))
    assert set(saved) == set(routers_after)
    for name, tensor in saved.items():
        assert torch.equal(tensor, routers_after[name]), name
    assert _leftovers(tmp_path) == []


def _crash_after(model, calls: int):
    """A forward pre-hook that raises on the model's call number ``calls + 1``: a crash in the middle of training."""
    seen = [0]

    def hook(module, args, kwargs):
        seen[0] += 1
        if seen[0] > calls:
            raise KeyboardInterrupt("simulated crash")

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _assert_same_run(a, b, history_a, history_b):
    assert [s for s, _ in history_a] == [s for s, _ in history_b]
    assert [loss for _, loss in history_a] == pytest.approx([loss for _, loss in history_b], abs=1e-6, rel=0)
    ta, tb = _router_tensors(a), _router_tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], rtol=0, atol=1e-6)


SETTINGS = dict(batch_size=2, lr=5e-2, checkpoint_every=2, seed=3)


@pytest.mark.parametrize("warmup", [1, 10])
def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path, warmup):
    """warmup=1: the cosine schedule is live over the 4 steps; warmup=10: all 4 steps are in warm-up."""
    settings = dict(SETTINGS, warmup=warmup)
    whole = _composed()
    full = retrofit(whole, _windows(), tmp_path / "whole", RetrofitSettings(steps=4, **settings), progress=False)
    assert len(full["history"]) == 4
    final = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    assert final["step"] == 4 and final["history"] == full["history"]

    crashed = _composed()
    handle = _crash_after(crashed, 2)
    with pytest.raises(KeyboardInterrupt):
        retrofit(crashed, _windows(), tmp_path / "cut", RetrofitSettings(steps=4, **settings), progress=False)
    handle.remove()
    state = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert state["step"] == 2 and len(state["history"]) == 2
    assert _leftovers(tmp_path / "cut") == []

    resumed = _composed(router_seed=99)  # a fresh process: its own random routers, which the checkpoint replaces
    out = retrofit(resumed, _windows(), tmp_path / "cut", RetrofitSettings(steps=4, **settings), resume=True,
                   progress=False)
    _assert_same_run(resumed, whole, out["history"], full["history"])
    assert _leftovers(tmp_path) == []
    kept = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["step_seconds"]  # the first two from before the crash
    assert kept[:2] == state["step_seconds"] and len(kept) == 4 and all(seconds > 0 for seconds in kept)


def test_resume_a_shorter_run(tmp_path):
    """The brief's literal scenario: a run of 2 steps, then resume=True with steps=4 (warm-up covers all 4 steps,
    so the learning rates of the two schedules agree)."""
    settings = dict(SETTINGS, warmup=10)
    whole = _composed()
    full = retrofit(whole, _windows(), tmp_path / "whole", RetrofitSettings(steps=4, **settings), progress=False)

    part = _composed()
    retrofit(part, _windows(), tmp_path / "part", RetrofitSettings(steps=2, **settings), progress=False)
    assert load_checkpoint(tmp_path / "part" / "checkpoint.pt")["step"] == 2
    resumed = _composed(router_seed=99)
    out = retrofit(resumed, _windows(), tmp_path / "part", RetrofitSettings(steps=4, **settings), resume=True,
                   progress=False)
    _assert_same_run(resumed, whole, out["history"], full["history"])
    assert _leftovers(tmp_path) == []


def test_resume_refuses_a_length_that_changes_the_learning_rates_of_the_steps_done(tmp_path):
    """Past the warm-up the cosine decay spans the run: 3 steps of a 3-step run (warm-up 1) were taken at other
    rates than a 6-step run takes them, so resuming them as 6 steps would not be the 6-step run; and a run
    cannot end before the steps its checkpoint holds."""
    settings = dict(SETTINGS, warmup=1)
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=3, **settings), progress=False)
    with pytest.raises(ValueError, match="steps: expected 3, the value in .*, or a length under which its 3 steps "
                                         "have the learning rates they were trained with"):
        retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=6, **settings), resume=True,
                 progress=False)
    with pytest.raises(ValueError, match="steps: expected at least the 3 steps .* has trained, got 2"):
        retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=2, **settings), resume=True,
                 progress=False)


def test_resume_refuses_another_frozen_base(tmp_path):
    """Routers resumed on other weights of the same architecture would have trained on two models."""
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS), progress=False)
    other = sa.compose(tiny_model("llama", seed=1), CONFIG)
    with pytest.raises(ValueError, match="base: expected 'sha256:[0-9a-f]{16}', what .*checkpoint.pt was trained "
                                         "with, got 'sha256:"):
        retrofit(other, _windows(), tmp_path, RetrofitSettings(steps=4, **SETTINGS), resume=True, progress=False)


def test_resume_refuses_another_jobs_checkpoint(tmp_path):
    from sieve_attn.train.finetune import FinetuneSettings, finetune

    finetune(sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4)), _windows(), tmp_path,
             FinetuneSettings(steps=2, batch_size=2, checkpoint_every=1), progress=False)
    with pytest.raises(ValueError, match="out_dir: expected a folder whose checkpoint a retrofit run wrote, got "
                                         ".*checkpoint.pt, written by finetune"):
        retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS), resume=True,
                 progress=False)


def test_resume_refuses_a_base_model_of_another_dtype(tmp_path):
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS), progress=False)
    with pytest.raises(ValueError, match="dtype: expected 'torch.float32', what .* was trained with, got "
                                         "'torch.bfloat16'"):
        retrofit(_composed().to(torch.bfloat16), _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS),
                 resume=True, progress=False)


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    a, b = _composed(), _composed()
    ha = retrofit(a, _windows(), tmp_path / "a", RetrofitSettings(steps=2, **SETTINGS), progress=False)["history"]
    hb = retrofit(b, _windows(), tmp_path / "b", RetrofitSettings(steps=2, **SETTINGS), resume=True,
                  progress=False)["history"]
    _assert_same_run(a, b, ha, hb)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"step": 1, "weights": torch.ones(3)}, path)
    real_save = torch.save

    def crash_mid_write(obj, f, *args, **kwargs):
        real_save({"step": "partial"}, f)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError):
        save_checkpoint({"step": 2, "weights": torch.zeros(3)}, path)
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert load_checkpoint(tmp_path / "missing.pt") is None


def test_atomic_writes_clear_a_killed_writers_leftovers_and_leave_files_others_can_read(tmp_path):
    (tmp_path / ".checkpoint.pt.5ca1ab1e").write_bytes(b"half a checkpoint")  # a writer killed mid-write
    (tmp_path / ".other.pt.5ca1ab1e").write_bytes(b"another file's")
    save_checkpoint({"step": 1}, tmp_path / "checkpoint.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.5ca1ab1e", "checkpoint.pt"]
    (tmp_path / ".run[1].pt.5ca1ab1e").write_bytes(b"half")  # a name glob would read as a pattern
    save_checkpoint({"step": 1}, tmp_path / "run[1].pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.5ca1ab1e", "checkpoint.pt", "run[1].pt"]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "checkpoint.pt").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_failed_write_names_the_file_and_keeps_the_one_before(tmp_path):
    from sieve_attn._files import atomic_write

    save_checkpoint({"step": 1}, tmp_path / "checkpoint.pt")

    def full_disk(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 0")

    with pytest.raises(OSError, match=r"checkpoint.pt: could not be written \(\[enforce fail.*\); the file there "
                                      r"before, if any, is as it was"):
        atomic_write(tmp_path / "checkpoint.pt", full_disk)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_safetensors_write_killed_midway_leaves_nothing_the_next_write_keeps(tmp_path):
    """safetensors writes a temporary file of its own (0600) and renames it over the one it was given: it lies in
    the writer's temporary folder, which the next write of the same path removes, and the file written gets the
    permissions of a plain open."""
    from safetensors.torch import save_file

    from sieve_attn._files import atomic_write

    killed = tmp_path / ".adapter.safetensors.5ca1ab1e"
    killed.mkdir()
    (killed / ".tmpAbC123").write_bytes(b"half of safetensors' own temporary file")
    (tmp_path / ".adapter.safetensors.backup").mkdir()  # a name atomic_write never gives: the user's
    atomic_write(tmp_path / "adapter.safetensors", lambda tmp: save_file({"w": torch.ones(2)}, tmp))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".adapter.safetensors.backup", "adapter.safetensors"]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "adapter.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("field, value", [("checkpoint_every", 0), ("warmup", -1), ("steps", 0)])
def test_retrofit_refuses_bad_settings(tmp_path, field, value):
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4))
    with pytest.raises(ValueError, match=f"{field}: expected an int"):
        retrofit(model, _windows(), tmp_path, RetrofitSettings(**{field: value}), progress=False)


def test_micro_batch_must_divide_the_batch(tmp_path):
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4))
    with pytest.raises(ValueError, match=r"micro_batch: expected a divisor of each process's share of the batch "
                                         r"\(4 windows\), got 3"):
        retrofit(model, _windows(), tmp_path, RetrofitSettings(steps=1, batch_size=4, micro_batch=3), progress=False)
    with pytest.raises(ValueError, match="micro_batch: expected an int"):
        retrofit(model, _windows(), tmp_path, RetrofitSettings(steps=1, micro_batch=0), progress=False)


def test_retrofit_lowers_the_loss_it_trains_on(tmp_path):
    """Descent: routers trained on one window, step after step, lower that window's loss (5.22 -> 4.69 over 8
    steps; the same steps up the gradient end at 5.33). The other tests compare runs with each other, which a step
    the wrong way passes."""
    model = _composed()
    window = random_ids(1, 32, seed=5)
    history = retrofit(model, window, tmp_path, RetrofitSettings(steps=8, batch_size=1, lr=3e-2, warmup=0),
                       progress=False)["history"]
    losses = [loss for _, loss in history]
    assert losses[-1] < losses[0] - 0.2, losses


def test_retrofit_refuses_a_plain_model(tmp_path):
    with pytest.raises(ValueError, match="^model: expected a model composed with sieve_attn.compose, got a plain "
                                         "model$"):
        retrofit(tiny_model("llama"), _windows(), tmp_path, RetrofitSettings(steps=1), progress=False)


def test_resume_refuses_a_checkpoint_of_another_pattern(tmp_path):
    """Same router shapes, another window: refused by the recorded configs, before the routers are restored."""
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=1, **dict(SETTINGS, checkpoint_every=1)),
             progress=False)
    wider = sa.compose(tiny_model("llama", seed=0), sa.FocusConfig(num_groups=4, window=8, top_k=2))
    with pytest.raises(ValueError, match="model: expected .*'window': 4.*what .*checkpoint.pt was trained with"):
        retrofit(wider, _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS), resume=True, progress=False)


def test_resume_refuses_a_checkpoint_of_other_routers(tmp_path):
    """A checkpoint older than the recorded configs: the routers' shapes are still checked."""
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=1, **dict(SETTINGS, checkpoint_every=1)),
             progress=False)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del state["identity"]
    torch.save(state, tmp_path / "checkpoint.pt")
    wider = sa.compose(tiny_model("llama", seed=0), sa.FocusConfig(num_groups=8, window=4, top_k=2))
    with pytest.raises(ValueError, match="checkpoint tensor .*centroids: expected shape \\(8, 16\\), got \\(4, 16\\)"):
        retrofit(wider, _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS), resume=True, progress=False)


@pytest.mark.parametrize("routing", ["sinkhorn", "causal"])
def test_activation_checkpointing_trains_the_same_routers(tmp_path, routing):
    """Recomputing each layer's forward in backward (as FSDP's activation checkpointing does) runs the routers again:
    their running group biases must still be updated once per step, and the causal routing must see the same ones."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = sa.FocusConfig(num_groups=4, window=4, top_k=2, train_routing=routing)
    plain, wrapped = (sa.compose(tiny_model("llama", seed=0), config) for _ in range(2))
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    settings = RetrofitSettings(steps=3, **SETTINGS)
    a = retrofit(plain, _windows(), tmp_path / "plain", settings, progress=False)["history"]
    b = retrofit(wrapped, _windows(), tmp_path / "wrapped", settings, progress=False)["history"]
    assert [loss for _, loss in b] == pytest.approx([loss for _, loss in a], abs=1e-6, rel=0)
    ta, tb = adapter_state(plain), adapter_state(wrapped)  # state_dict keys: the wrappers' prefix is left out
    assert set(ta) == set(tb)
    for name in ta:
        torch.testing.assert_close(tb[name], ta[name], rtol=0, atol=1e-6, msg=name)


class _KeepGrads:
    """An optimizer that clears gradients and leaves each step's for the test to read."""

    def __init__(self, params):
        self.params = list(params)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        pass


def test_micro_batches_give_the_gradients_and_biases_of_the_whole_batch():
    """One step over a batch of 4 as 2 micro-batches of 2: the same loss, router gradients (not a multiple of them)
    and updated group biases as over the whole batch, to float rounding."""
    from sieve_attn.integrations.transformers import set_focus_mode
    from sieve_attn.train import retrofit as retrofit_module
    from sieve_attn.train.distributed import Runtime

    batch = _windows()[:4]
    results = []
    for parts in (1, 2):
        model = _composed()
        model.eval()
        set_focus_mode(model, "train")
        trainable = retrofit_module._router_parameters(model)
        (loss,) = retrofit_module._train_step(model, trainable, _KeepGrads(trainable), Runtime(),
                                              batch.split(4 // parts))
        biases = [b.clone() for b in retrofit_module._router_buffers(model)]
        results.append((loss, [p.grad.clone() for p in trainable], biases))
    (loss_whole, grads_whole, biases_whole), (loss_micro, grads_micro, biases_micro) = results
    assert loss_micro == pytest.approx(loss_whole, rel=1e-6)
    for whole, micro in zip(grads_whole + biases_whole, grads_micro + biases_micro):
        torch.testing.assert_close(micro, whole, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 1e-4 for g in grads_whole)  # gradients that a wrong scale would change


def test_causal_training_routing_refuses_micro_batches(tmp_path):
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4, train_routing="causal"))
    with pytest.raises(ValueError, match="^train_routing: expected 'sinkhorn' when training with micro-batches"):
        retrofit(model, _windows(), tmp_path, RetrofitSettings(steps=1, batch_size=4, micro_batch=2), progress=False)


def test_resume_from_a_checkpoint_without_step_times_keeps_them_aligned(tmp_path):
    """A checkpoint of an earlier version holds no step times: its steps get None, so index s stays step s + 1."""
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=2, **SETTINGS), progress=False)
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    del state["step_seconds"]
    save_checkpoint(state, tmp_path / "checkpoint.pt")
    retrofit(_composed(), _windows(), tmp_path, RetrofitSettings(steps=4, **SETTINGS), resume=True, progress=False)
    seconds = load_checkpoint(tmp_path / "checkpoint.pt")["step_seconds"]
    assert seconds[:2] == [None, None] and len(seconds) == 4 and all(s > 0 for s in seconds[2:])
