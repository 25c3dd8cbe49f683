"""Router-only training of a composed model: the pretrained weights stay frozen, only Focus routers learn."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .._checks import check_tensors_fit, fail
from ..config import FocusConfig
from ..integrations.transformers import (SFA_ATTR, adapter_state, composed_configs, focus_layers, is_composed,
                                          save_adapter, set_focus_mode)
from . import distributed, loop
from .checkpoint import sampled_digest, tensors_digest


@dataclass
class RetrofitSettings(loop.TrainSettings):
    steps: int = 200
    lr: float = 1e-2


def _check_arguments(model, windows: torch.Tensor, settings: RetrofitSettings) -> None:
    """ValueError unless the settings are valid, the windows are [N >= 1, T] and only Focus routers can train."""
    loop.check_settings(windows, settings)
    if not is_composed(model):
        fail("model", "a model composed with sieve_attn.compose", "a plain model")
    routers = {id(p) for layer in focus_layers(model) for p in layer.parameters()}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    others = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in routers]
    if not trainable or others:
        fail("model", "trainable parameters that are all Focus router parameters", others[:3] or "none trainable")


def check_routing(config: FocusConfig, settings: RetrofitSettings, processes: int) -> None:
    """ValueError when ``config`` routes causally in training across ``processes`` > 1 or micro-batches: causal
    routing uses the group biases in the same forward that updates them, and on several processes or
    micro-batches each forward would update them from its own part of the batch, so the routers would differ from
    those of one forward over the whole batch."""
    if config.train_routing != "causal":
        return
    if processes > 1:
        fail("train_routing", "'sinkhorn' when training on several processes (with 'causal' each process's "
                              "forward would use group biases of its own share of the batch)", "'causal'")
    if settings.micro_batch is not None and settings.micro_batch < settings.batch_size:
        fail("train_routing", "'sinkhorn' when training with micro-batches (with 'causal' each micro-batch's "
                              "forward would use group biases of its own part of the batch)", "'causal'")


def _router_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable router parameters, layer by layer: the order of ``model.named_parameters()``, which the
    optimizer state in checkpoints follows, found from the modules (activation checkpointing renames the layers)."""
    return [p for layer in focus_layers(model) for p in layer.parameters() if p.requires_grad]


def _load_routers(model, routers: dict[str, torch.Tensor]) -> None:
    """Copies a checkpoint's router tensors into the model's own, through the state-dict views ``adapter_state``
    returns (also right when FSDP shards the base or activation checkpointing renames the layers)."""
    current = adapter_state(model)
    check_tensors_fit("checkpoint", routers, current, "router tensors of this model")
    with torch.no_grad():
        for name, tensor in routers.items():
            current[name].copy_(tensor)


def _router_buffers(model) -> list[torch.Tensor]:
    return [buffer for layer in focus_layers(model) for buffer in layer.buffers()]


def _copy(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for target, value in zip(targets, values):
        target.copy_(value)


def _train_step(model, trainable, optimizer, runtime, micro_batches: tuple[torch.Tensor, ...]) -> tuple[float]:
    """One optimizer step on this process's share of a global batch, given as equal micro-batches; returns (the loss
    of the global batch,)."""
    buffers = _router_buffers(model)
    before = [buffer.clone() for buffer in buffers]
    updated = [torch.zeros_like(buffer) for buffer in buffers]
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch in micro_batches:
        loss = model(batch, labels=batch, use_cache=False).loss / len(micro_batches)
        for sum_, buffer in zip(updated, buffers):
            sum_ += buffer / len(micro_batches)
        # Each micro-batch starts from the biases the step started from, and the step ends at the mean of their
        # updates: what processes that each took one micro-batch do. Backward runs with the biases this forward
        # left: a layer that activation checkpointing recomputes there routes with them and does not update them
        # again (FocusRouter.training_assign).
        loss.backward()
        _copy(buffers, before)
        total += loss.detach()
    _copy(buffers, updated)
    runtime.average_gradients(trainable)
    runtime.average_(buffers)  # each process updated them from its own share of the batch
    optimizer.step()
    return (runtime.mean(total),)


def _frozen_digests(model) -> dict:
    """{"base": sampled digest of the model's own weights and buffers, "sfa": digest of its SFA parts (only where
    composed)}."""
    added = adapter_state(model)
    sfa = {k: v for k, v in added.items() if f".{SFA_ATTR}." in k}
    digests = {"base": sampled_digest({k: v for k, v in model.state_dict().items() if k not in added})}
    return {**digests, "sfa": tensors_digest(sfa)} if sfa else digests


def _restore(model, optimizer, state: dict) -> None:
    _load_routers(model, state["routers"])
    optimizer.load_state_dict(state["optimizer"])


def retrofit(model, windows: torch.Tensor, out_dir, settings: RetrofitSettings | None = None, *,
             resume: bool = False, progress: bool = True, weights_digest: str | None = None) -> dict:
    """Trains the Focus routers of a composed ``model`` on token windows [N, T] with the LM loss.

    AdamW over the router parameters only; the base model runs in eval mode (no dropout) with its weights frozen,
    and so do SFA's parts where the model is composed with SFA too (Focus retrofitted onto an SFA model).
    Every ``checkpoint_every`` steps and at the end, ``out_dir/checkpoint.pt`` is written atomically (routers,
    optimizer, step, loss history, step times); ``resume=True`` continues from it. ``micro_batch`` splits each
    process's share of a batch into micro-batches whose gradients add up (:class:`~.loop.TrainSettings`). The
    trained adapter goes to ``out_dir/adapter``. ``weights_digest``: the digest of fine-tuned weights the model
    was given (:func:`sieve_attn.train.finetune.load_weights`), which a resumed run must share and the adapter
    records (None: the model's own). Returns {"steps", "history" (list of (step, loss)), "adapter",
    "train_seconds" (:func:`~sieve_attn.train.loop.train_seconds`)}.

    Under a launcher of several processes (``accelerate launch``, ``torchrun``) every process calls this with the
    same arguments: each trains on its share of every global batch (``batch_size`` must be a multiple of the number of
    processes), router gradients are averaged, the history holds the mean loss over processes, and rank 0 alone
    writes checkpoints and the adapter and shows progress. With an FSDP launch configuration the frozen base is
    sharded in place. The rules are in :mod:`sieve_attn.train.distributed`.
    """
    settings = settings or RetrofitSettings()
    _check_arguments(model, windows, settings)
    runtime = distributed.runtime(settings.batch_size)
    check_routing(model.sieve_config, settings, runtime.world_size)
    identity = {"model": composed_configs(model),
                "dtype": str(model.get_input_embeddings().weight.dtype)}  # the frozen base's
    if weights_digest is not None:
        identity["weights"] = weights_digest
    # What stays frozen: the base (another checkpoint of the same architecture would train the routers on two
    # models) and SFA's parts where composed. Read before placing (FSDP shards them), on rank 0, the only one
    # holding weights then under FSDP's CPU-RAM-efficient loading.
    identity.update(runtime.main_value(_frozen_digests(model) if runtime.is_main else None))
    runtime.place(model)
    trainable = _router_parameters(model)  # after placing: moving the routers may have replaced them
    inference_mode = model.sieve_config.mode
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=0.0)
    job = loop.Job("retrofit", step=partial(_train_step, model, trainable, optimizer, runtime),
                   snapshot=lambda: {"routers": adapter_state(model), "optimizer": optimizer.state_dict()},
                   restore=partial(_restore, model, optimizer), identity=identity)
    model.eval()
    set_focus_mode(model, "train")
    for layer in focus_layers(model):
        layer.router.train()
    try:
        history, _, step_seconds = loop.run(job, windows, out_dir, settings, optimizer, runtime,
                                            device=next(model.parameters()).device, resume=resume,
                                            progress=progress)
    finally:
        for layer in focus_layers(model):
            layer.router.eval()
        set_focus_mode(model, inference_mode)
    adapter = Path(out_dir) / "adapter"
    runtime.write(lambda: save_adapter(model, adapter, weights_digest=weights_digest))
    return {"steps": settings.steps, "history": history, "adapter": str(adapter),
            "train_seconds": loop.train_seconds(step_seconds)}
