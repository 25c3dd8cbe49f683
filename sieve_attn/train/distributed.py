"""Training across several processes, through accelerate (``accelerate launch`` or ``torchrun``).

:func:`~sieve_attn.train.retrofit.retrofit` (router-only) and :func:`~sieve_attn.train.finetune.finetune` (every
weight of the model) follow these rules whenever the launcher started more than one process (``WORLD_SIZE`` > 1);
in one plain process nothing here runs.

- Data. Step s trains on the same global batch of ``batch_size`` windows that one process would use. With W
  processes, rank r takes the r-th contiguous slice of ``batch_size / W`` of them, so ``batch_size`` must be a
  multiple of W. Every window has the same length, so the mean over ranks of each rank's mean loss is the loss of the
  global batch (and likewise fine-tuning's output-matching term, a mean over equally many elements per window): the
  loss curve, the gradients and the trained weights are those of one process, up to float rounding.
- The model, replicated (the default, DDP-style). Every rank holds the whole model on its own device and starts from
  rank 0's values of what it trains (as DDP does). The gradients of the trained tensors are averaged by all-reduces
  of buckets of at most ``BUCKET_ELEMENTS`` values each step, so the optimizer states are the same on every rank.
- The model, sharded with FSDP2 when the launch carries an FSDP configuration (``accelerate launch --use_fsdp
  --fsdp_version 2 ...``): accelerate's FSDP2 routine shards it while the Focus and SFA layers are taken out, so
  routers and SFA feature maps stay plain replicated tensors (treated as above). FSDP2 averages the gradients of
  the sharded weights itself (a reduce-scatter): they are not averaged again. Retrofit shards a frozen base;
  fine-tuning trains the sharded weights, and its optimizer, built after sharding, holds only this rank's shards of
  them.
- Files. Checkpoints, adapters and weights are written by rank 0 alone, in the single-process format (sharded
  tensors are gathered first): a checkpoint of W processes resumes in any number of processes.
- Retrofit's running group biases (each rank's forward updates them from its own share) are averaged after every
  step, which gives the biases of one process because the update is linear. ``train_routing="causal"`` is refused:
  it uses the biases in the very forward that updates them, which would then differ between processes.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._checks import fail
from ..integrations.transformers import LAYER_ATTR, SFA_ATTR, adapter_state, attention_modules


def processes() -> int:
    """How many processes the launcher started (accelerate launch and torchrun set ``WORLD_SIZE``; 1 without)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched() -> bool:
    """Whether a launcher started several processes."""
    return processes() > 1


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
    """(model in eval mode, tokenizer) for retrofit or fine-tuning, placed for this process.

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
    return load_model(name, dtype=dtype, device=None)


def local_share(batch_size: int, rank: int, world_size: int) -> slice:
    """The slice of each global batch that ``rank`` of ``world_size`` trains on (see the module docstring)."""
    if batch_size % world_size:
        fail("batch_size", f"a multiple of the {world_size} processes (each takes an equal share of every batch)",
             batch_size)
    share = batch_size // world_size
    return slice(rank * share, (rank + 1) * share)


# One all-reduce averages at most this many gradient values (64 MB in float32): the buffer it needs stays small next
# to a model whose gradients would double in memory if they were concatenated all at once.
BUCKET_ELEMENTS = 1 << 24


class Runtime:
    """One plain process: nothing is shared. :class:`Distributed` overrides every method."""

    is_main = True
    world_size = 1

    def place(self, model) -> None:
        """Prepares the composed ``model`` for this process (in place); call it again before building an optimizer
        over parameters found after an evaluation, which may have left some of them gathered (FSDP2)."""

    def replicate_(self, tensors) -> None:
        """Gives every process rank 0's values of ``tensors`` (in place), as DDP does for a model's parameters;
        parameters sharded by FSDP2 (DTensors) are left as they are."""

    def share(self, picks: list[int]) -> list[int]:
        """This process's part of a global batch given as window indices."""
        return picks

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Replaces each tensor by its mean over the processes (in place)."""

    def average_gradients(self, params) -> None:
        """Averages over the processes the gradients of ``params`` that FSDP2 does not average itself: those of
        parameters it does not shard (plain tensors, not DTensors)."""

    def mean(self, value: torch.Tensor) -> float:
        """The mean over the processes of a scalar tensor."""
        return value.item()

    def main_value(self, value):
        """Rank 0's ``value`` (any picklable object), on every process: what only rank 0 can compute (under
        FSDP's CPU-RAM-efficient loading the other ranks hold no weights yet)."""
        return value

    def wait(self) -> None:
        """Returns once every process got here."""

    def write(self, write) -> None:
        """Calls ``write()`` on the main process only and returns once it has returned there: a file written this way
        is on disk when any process goes on (and a rank failing later cannot make the launcher stop rank 0 in the
        middle of the write)."""
        if self.is_main:
            write()
        self.wait()


class Distributed(Runtime):
    """Several processes started by a launcher, joined through ``accelerator`` (see the module docstring)."""

    def __init__(self, accelerator, batch_size: int):
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.world_size = accelerator.num_processes
        self._share = local_share(batch_size, accelerator.process_index, self.world_size)

    def place(self, model) -> None:
        """Shards ``model`` with FSDP2 when the launch asks for it (a model already sharded is only resharded: see
        :func:`_reshard`), then gives every process rank 0's Focus routers (parameters and buffers) and SFA
        feature maps."""
        plugin = fsdp_plugin(self.accelerator)
        if plugin is not None and _is_sharded(model):
            _reshard(model)
        elif plugin is not None:
            layers = _shard_base(self.accelerator, plugin, model)
            _move_layers(layers, self.accelerator.device)
        self.replicate_(adapter_state(model).values())  # views of the router tensors: broadcast writes into them

    def replicate_(self, tensors) -> None:
        with torch.no_grad():
            for tensor in tensors:
                if not isinstance(tensor, DTensor):
                    dist.broadcast(tensor.detach(), src=0)

    def share(self, picks: list[int]) -> list[int]:
        return picks[self._share]

    def average_(self, tensors: list[torch.Tensor]) -> None:
        for bucket in buckets(tensors, BUCKET_ELEMENTS):
            flat = torch.cat([t.detach().reshape(-1).float() for t in bucket])
            dist.all_reduce(flat)  # a sum: gloo has no average
            flat /= self.world_size
            for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(part.view_as(tensor))

    def average_gradients(self, params) -> None:
        self.average_([p.grad for p in params if p.grad is not None and not isinstance(p, DTensor)])

    def mean(self, value: torch.Tensor) -> float:
        total = value.detach().float().reshape(1).clone()
        dist.all_reduce(total)
        return total.item() / self.world_size

    def main_value(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()


def runtime(batch_size: int) -> Runtime:
    """The runtime of this process: :class:`Distributed` under a launcher of several processes, else :class:`Runtime`.
    Raises ValueError when ``batch_size`` cannot be split evenly over the processes."""
    return Distributed(start(), batch_size) if launched() else Runtime()


def buckets(tensors: list[torch.Tensor], limit: int):
    """``tensors`` cut, in order, into consecutive lists of at most ``limit`` elements in all; a tensor larger than
    ``limit`` forms a list of its own."""
    bucket, size = [], 0
    for tensor in tensors:
        if bucket and size + tensor.numel() > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel()
    if bucket:
        yield bucket


def _is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _reshard(model) -> None:
    """Puts every FSDP2 unit of ``model`` back in its sharded state. A forward without backward (an evaluation)
    leaves the units that do not reshard after forward (the root, the output head) holding gathered plain tensors
    as their parameters; an optimizer must be built over the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _shard_base(accelerator, plugin, model) -> list:
    """Shards ``model`` (all of it but the layers compose added: Focus layers and SFA layers) in place with
    accelerate's FSDP2 routine (activation checkpointing first when the configuration asks for it); returns those
    layers, attached again.

    They are out of the model while it is sharded: FSDP then never sees the routers and the SFA feature maps, which
    stay plain tensors, and accelerate's CPU-RAM-efficient loading (which expects every entry of the state dict to
    be sharded) is not confused by them. ``Accelerator.prepare`` is not used because under FSDP2 it needs an
    optimizer of the model's parameters, which retrofit does not have (its base is frozen) and fine-tuning can only
    build over the sharded parameters, after sharding.
    """
    from accelerate.utils import fsdp2_apply_ac, fsdp2_prepare_model

    added = [(module, name, getattr(module, name)) for _, module in attention_modules(model)
             for name in (LAYER_ATTR, SFA_ATTR) if hasattr(module, name)]
    for module, name, _ in added:
        delattr(module, name)
    try:
        if plugin.activation_checkpointing:
            plugin.set_auto_wrap_policy(model)
            fsdp2_apply_ac(accelerator, model)  # wraps the layers in place
        fsdp2_prepare_model(accelerator, model)  # shards in place (the model it returns is the same object)
    finally:
        for module, name, layer in added:
            module.add_module(name, layer)
    return [layer for _, _, layer in added]


def _move_layers(layers, device) -> None:
    """Moves Focus and SFA layers to ``device``. Layers built on a model left empty (meta) by CPU-RAM-efficient
    loading get uninitialised storage there; rank 0's values are broadcast into them next."""
    for layer in layers:
        if any(t.is_meta for t in itertools.chain(layer.parameters(), layer.buffers())):
            layer.to_empty(device=device)
        else:
            layer.to(device)
