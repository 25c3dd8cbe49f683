"""Router-only retrofit across several processes, through accelerate (``accelerate launch`` or ``torchrun``).

:func:`~sieve_attn.train.retrofit.retrofit` follows these rules whenever the launcher started more than one process
(``WORLD_SIZE`` > 1); in one plain process nothing here runs.

- Data. Step s trains on the same global batch of ``batch_size`` windows that one process would use. With W
  processes, rank r takes the r-th contiguous slice of ``batch_size / W`` of them, so ``batch_size`` must be a
  multiple of W. Every window has the same length, so the mean over ranks of each rank's mean loss is the loss of the
  global batch: the loss curve, the gradients and the trained routers are those of one process, up to float rounding.
- Routers. Replicated on every rank, never sharded (a 70B model has 10.5M router parameters, 42 MB in float32). Every
  rank starts from rank 0's routers; gradients are averaged by one all-reduce per step; the running group biases
  (each rank's forward updates them from its own share) are averaged after every step, which gives the biases of
  one process because the update is linear. The optimizer states are thus the same on every rank, and checkpoints
  and adapters are written by rank 0 alone, in the single-process format: a checkpoint of W processes resumes in any
  number of processes. ``train_routing="causal"`` is refused: it uses the biases in the very forward that updates
  them, which would then differ between processes.
- Base model. Frozen, so nothing of it is synchronised. Replicated by default (every rank holds it on its own device,
  as under DDP), or sharded with FSDP2 when the launch carries an FSDP configuration (``accelerate launch --use_fsdp
  --fsdp_version 2 ...``): accelerate's FSDP2 routine shards the base while the Focus layers are taken out, so the
  routers stay plain replicated tensors.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist

from .._checks import fail
from ..integrations.transformers import LAYER_ATTR, adapter_state, attention_modules


def launched() -> bool:
    """Whether a launcher started several processes (accelerate launch and torchrun set ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device=None):
    """This process's ``accelerate.Accelerator``, which joins the process group: gloo on the CPU, NCCL on GPUs.

    The first call picks the kind from ``device`` ("cpu" or "cuda"; None: CUDA when available). Later calls, and
    calls after the caller made its own Accelerator, reuse the existing state. Start it before loading the model:
    on GPUs it selects this rank's device, and FSDP's CPU-RAM-efficient loading needs the process group.
    """
    from accelerate import Accelerator
    from accelerate.state import is_initialized

    if is_initialized():
        return Accelerator()
    cpu = not torch.cuda.is_available() if device is None else torch.device(device).type == "cpu"
    return Accelerator(cpu=cpu)


def is_main() -> bool:
    """Whether this process writes files and prints: always in one process, rank 0 under a launcher."""
    return not launched() or start().is_main_process


def finish() -> None:
    """The end of a launched script: if this process joined a process group, leaves it (a group left to the
    interpreter's shutdown makes NCCL warn, and can hang it) and exits with status 0 at once, every file already
    written. The interpreter's own teardown is skipped: there gloo's threads occasionally abort the process
    ("terminate called without an active exception", seen on 2-core CPU runs after training had finished). In a
    plain process this returns and does nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def fsdp_plugin(accelerator):
    """The launch's FSDP settings (``FullyShardedDataParallelPlugin``), or None when the base stays replicated.

    accelerate turns FSDP on only for accelerator devices. On the CPU (gloo) the settings the launcher exported
    (``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables) are applied here, so that CPU CI runs the sharded path; this
    needs a machine without visible GPUs, since FSDP puts its default device mesh on CUDA whenever CUDA is available.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    wanted = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if plugin is None and wanted and accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    if plugin is not None and plugin.fsdp_version != 2:
        fail("fsdp_version", "2 (FSDP2 shards per parameter, so frozen weights and trainable routers can share a "
                             "layer; launch with --fsdp_version 2)", plugin.fsdp_version)
    return plugin


def load_for_training(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model in eval mode, tokenizer) for retrofit, placed for this process.

    One process: on ``device``. Several with a replicated base: on the rank's own device. Several with FSDP: left
    where ``from_pretrained`` puts it, the CPU, which FSDP shards onto the devices; under FSDP's CPU-RAM-efficient
    loading only rank 0 holds the weights and the other ranks hold empty (meta) tensors that FSDP fills.
    """
    from ..models import load_model

    if not launched():
        return load_model(name, dtype=dtype, device=device)
    accelerator = start(device)
    if fsdp_plugin(accelerator) is None:
        return load_model(name, dtype=dtype, device=str(accelerator.device))
    return _load_unplaced(name, dtype)


def _load_unplaced(name: str, dtype: torch.dtype):
    """:func:`sieve_attn.models.load_model` without its final ``.to(device)``, which tensors left empty (meta) by
    CPU-RAM-efficient loading cannot do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import DEFAULT_MODEL, smollm2_gguf

    kwargs = {}
    if name == DEFAULT_MODEL:
        gguf = smollm2_gguf()
        name, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs).eval(), tokenizer


def local_share(batch_size: int, rank: int, world_size: int) -> slice:
    """The slice of each global batch that ``rank`` of ``world_size`` trains on (see the module docstring)."""
    if batch_size % world_size:
        fail("batch_size", f"a multiple of the {world_size} processes (each takes an equal share of every batch)",
             batch_size)
    share = batch_size // world_size
    return slice(rank * share, (rank + 1) * share)


class Runtime:
    """One plain process: nothing is shared. :class:`Distributed` overrides every method."""

    is_main = True

    def place(self, model) -> None:
        """Prepares the composed ``model`` for this process (in place)."""

    def share(self, picks: list[int]) -> list[int]:
        """This process's part of a global batch given as window indices."""
        return picks

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Replaces each tensor by its mean over the processes (in place)."""

    def mean(self, value: torch.Tensor) -> float:
        """The mean over the processes of a scalar tensor."""
        return value.item()

    def wait(self) -> None:
        """Returns once every process got here."""


class Distributed(Runtime):
    """Several processes started by a launcher, joined through ``accelerator`` (see the module docstring)."""

    def __init__(self, accelerator, batch_size: int):
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.world_size = accelerator.num_processes
        self._share = local_share(batch_size, accelerator.process_index, self.world_size)

    def place(self, model) -> None:
        if model.sieve_config.train_routing == "causal":
            # Causal routing uses the group biases in the same forward that updates them, and here each process
            # would update them from its own share of the batch: the routers would differ from one process's.
            fail("train_routing", "'sinkhorn' when training on several processes (with 'causal' each process's "
                                  "forward would use group biases of its own share of the batch)", "'causal'")
        plugin = fsdp_plugin(self.accelerator)
        if plugin is not None:
            layers = _shard_base(self.accelerator, plugin, model)
            _move_layers(layers, self.accelerator.device)
        for tensor in adapter_state(model).values():  # views of the router tensors: broadcast writes into them
            dist.broadcast(tensor, src=0)

    def share(self, picks: list[int]) -> list[int]:
        return picks[self._share]

    def average_(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        dist.all_reduce(flat)  # a sum: gloo has no average
        flat /= self.world_size
        for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(part.view_as(tensor))

    def mean(self, value: torch.Tensor) -> float:
        total = value.detach().float().reshape(1).clone()
        dist.all_reduce(total)
        return total.item() / self.world_size

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()


def runtime(batch_size: int) -> Runtime:
    """The runtime of this process: :class:`Distributed` under a launcher of several processes, else :class:`Runtime`.
    Raises ValueError when ``batch_size`` cannot be split evenly over the processes."""
    return Distributed(start(), batch_size) if launched() else Runtime()


def _shard_base(accelerator, plugin, model) -> list:
    """Shards the frozen base of the composed ``model`` in place with accelerate's FSDP2 routine (activation
    checkpointing first when the configuration asks for it); returns the Focus layers, attached again.

    The Focus layers are out of the model while it is sharded: FSDP then never sees the routers, which stay plain
    tensors, and accelerate's CPU-RAM-efficient loading (which expects every entry of the state dict to be sharded)
    is not confused by them. ``Accelerator.prepare`` is not used because under FSDP2 it needs an optimizer of the
    model's parameters, and the base has none to train.
    """
    from accelerate.utils import fsdp2_apply_ac, fsdp2_prepare_model

    hosts = [module for _, module in attention_modules(model)]
    layers = [getattr(module, LAYER_ATTR) for module in hosts]
    for module in hosts:
        delattr(module, LAYER_ATTR)
    try:
        if plugin.activation_checkpointing:
            plugin.set_auto_wrap_policy(model)
            fsdp2_apply_ac(accelerator, model)  # wraps the layers in place
        fsdp2_prepare_model(accelerator, model)  # shards in place (the model it returns is the same object)
    finally:
        for module, layer in zip(hosts, layers):
            module.add_module(LAYER_ATTR, layer)
    return layers


def _move_layers(layers, device) -> None:
    """Moves Focus layers to ``device``. Layers built on a model left empty (meta) by CPU-RAM-efficient loading get
    uninitialised storage there; rank 0's values are broadcast into them next."""
    for layer in layers:
        if any(t.is_meta for t in itertools.chain(layer.parameters(), layer.buffers())):
            layer.to_empty(device=device)
        else:
            layer.to(device)
