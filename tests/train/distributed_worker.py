"""One process of a distributed retrofit for test_distributed.py, started by ``accelerate launch``.

usage: distributed_worker.py OUT SETTINGS_JSON [--resume] [--die-after CALLS]

Trains the tiny Llama of test_retrofit.py with ``retrofit``: the same weights and token windows in every process;
rank 0's routers are those of ``composed()``, the other ranks' differ. ``--die-after CALLS`` kills the process at
its forward call number CALLS + 1, as a crash or ``kill -9`` would: no cleanup, no final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import sieve_attn as sa
from sieve_attn.train.distributed import finish, start
from sieve_attn.train.retrofit import RetrofitSettings, retrofit

try:
    from tests.models import random_ids, tiny_model
except ImportError:  # run from tests/train: tests/ is not a package on the path
    from models import random_ids, tiny_model

CONFIG = sa.FocusConfig(num_groups=4, window=4, top_k=2)


def composed(router_seed: int = 0) -> torch.nn.Module:
    """The tiny Llama (the same weights in every process) with Focus routers drawn from ``router_seed``."""
    model = tiny_model("llama", seed=0)
    torch.manual_seed(router_seed)
    return sa.compose(model, CONFIG)


def windows() -> torch.Tensor:
    return random_ids(8, 32, seed=11)


def _die_after(model, calls: int) -> None:
    seen = [0]

    def hook(module, args, kwargs):
        seen[0] += 1
        if seen[0] > calls:
            os._exit(17)

    model.register_forward_pre_hook(hook, with_kwargs=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("settings", type=json.loads)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start("cpu")  # gloo, also on a machine with GPUs
    # Every rank draws other routers: retrofit must start all of them from rank 0's, which are composed()'s.
    model = composed(router_seed=100 * int(os.environ["RANK"]))
    if args.die_after is not None:
        _die_after(model, args.die_after)
    retrofit(model, windows(), args.out, RetrofitSettings(**args.settings), resume=args.resume, progress=False)
    finish()


if __name__ == "__main__":
    main()
