"""One process of a distributed retrofit or fine-tune for test_distributed.py, started by ``accelerate launch``.

usage: distributed_worker.py OUT SETTINGS_JSON [--task retrofit|finetune] [--resume] [--die-after CALLS]

``--task retrofit`` (the default) trains the routers of the tiny Llama of test_retrofit.py with ``retrofit``; rank 0's
routers are those of ``composed()``, the other ranks' differ. ``--task finetune`` trains every weight of the tiny
Llama composed with SFA (``tuned()``) with ``finetune``; rank 0's weights are those of ``tuned()``, the other ranks'
differ. Every rank trains on the same token windows. Gradients are averaged in buckets of ``BUCKET`` values, so that
a fine-tuning step takes several all-reduces, some holding a single tensor larger than a bucket (retrofit's routers
fit in one). ``--die-after CALLS`` kills the process at its forward call number CALLS + 1 (one forward per step), as
a crash or ``kill -9`` would: no cleanup, no final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import sieve_attn as sa
from sieve_attn.train import distributed
from sieve_attn.train.finetune import FinetuneSettings, finetune
from sieve_attn.train.retrofit import RetrofitSettings, retrofit

try:
    from tests.models import random_ids, tiny_model
except ImportError:  # run from tests/train: tests/ is not a package on the path
    from models import random_ids, tiny_model

CONFIG = sa.FocusConfig(num_groups=4, window=4, top_k=2)
SFA = sa.SFAConfig(topk=4)
BUCKET = 4096  # values per all-reduce; the tiny Llama's embedding and LM head hold 6,400 each


def composed(router_seed: int = 0) -> torch.nn.Module:
    """The tiny Llama (the same weights in every process) with Focus routers drawn from ``router_seed``."""
    model = tiny_model("llama", seed=0)
    torch.manual_seed(router_seed)
    return sa.compose(model, CONFIG)


def tuned(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with weights drawn from ``seed``, composed with SFA (top-4 of its 16 coordinates)."""
    return sa.compose(tiny_model("llama", seed=seed), SFA)


def windows() -> torch.Tensor:
    return random_ids(8, 32, seed=11)


def _die_after(model, calls: int) -> None:
    seen = [0]

    def hook(module, args, kwargs):
        seen[0] += 1
        if seen[0] > calls:
            os._exit(17)

    model.register_forward_pre_hook(hook, with_kwargs=True)


def model_for(task: str, seed: int = 0) -> torch.nn.Module:
    """The model ``task`` trains: ``composed(seed)`` for retrofit, ``tuned(seed)`` for fine-tuning."""
    return composed(router_seed=seed) if task == "retrofit" else tuned(seed)


def validation() -> torch.Tensor:
    """Windows a validated fine-tune (``validate_every`` in its settings) measures its loss on."""
    return random_ids(3, 32, seed=13)


def train(task: str, model, out, settings: dict, *, resume: bool = False) -> None:
    """Trains ``model`` with ``task`` on ``windows()`` (without progress bars); a fine-tune whose settings have
    ``validate_every`` validates on ``validation()``."""
    if task == "retrofit":
        retrofit(model, windows(), out, RetrofitSettings(**settings), resume=resume, progress=False)
    else:
        finetune(model, windows(), out, FinetuneSettings(**settings), resume=resume, progress=False,
                 validation=validation() if settings.get("validate_every") else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("settings", type=json.loads)
    parser.add_argument("--task", choices=("retrofit", "finetune"), default="retrofit")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed.start("cpu")  # gloo, also on a machine with GPUs
    distributed.BUCKET_ELEMENTS = BUCKET
    # Every rank but 0 draws other routers or weights: training must start all of them from rank 0's.
    model = model_for(args.task, seed=100 * int(os.environ["RANK"]))
    if args.die_after is not None:
        _die_after(model, args.die_after)
    train(args.task, model, args.out, args.settings, resume=args.resume)
    distributed.finish()


if __name__ == "__main__":
    main()
