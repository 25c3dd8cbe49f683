"""Retrofit on two processes (CPU, gloo) against one process on the same data: loss, routers, adapter, resume.

Every two-process run is a real launch: a subprocess runs ``accelerate launch --num_processes 2`` on this machine
(127.0.0.1, a free port, no network). On a machine without GPUs ``--multi_gpu`` is accelerate's way to start several
processes (through torchrun); ``retrofit``'s Accelerator then joins them over gloo on the CPU. The training scripts
are ``distributed_worker.py`` (the tiny random Llama of tests/models.py on random token windows, and a simulated
``kill -9``) and the ``sieve retrofit`` command itself (a tiny Llama saved to a folder with a word-level tokenizer,
on real text).

The base model is tested both ways: replicated, DDP-style (the worker; nothing of the frozen base needs
synchronising), and sharded with FSDP2 (the command, ``--use_fsdp --fsdp_version 2`` with CPU-RAM-efficient loading,
so the second process loads an empty model that FSDP fills, and with activation checkpointing). accelerate itself turns FSDP on only for GPUs; on the CPU
``sieve_attn.train.distributed.fsdp_plugin`` applies the launcher's FSDP settings, so this is accelerate's own FSDP2
preparation and torch's ``fully_shard`` running on gloo.

Tolerances ("noise"). One process computes each step's batch of 4 windows at once; each of two processes computes 2
of them, and their gradients are summed, then halved. CPU kernels round differently for different batch shapes
(float32, about 1e-7 relative). Measured at the default lr 1e-2: losses agree to 2e-7 relative (tolerance 1e-5),
router tensors to 6e-7 absolute (tolerance 1e-5). At lr 5e-2 Sinkhorn's potentials and Adam amplify the same
rounding to 8e-5 after 6 steps, hence the default lr here. Against these: skipping the gradient average moves the
losses by 4e-3 relative and the routers by 8e-2, skipping the group-bias average moves the biases by 0.5, and not
starting every rank from rank 0's routers moves the losses by 1e-2.

Not tested here (no GPU on CPU CI): NCCL, the per-GPU memory of the docs' table, FSDP's CPU offload and mixed-precision
policies, and several machines.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import sieve_attn as sa
from sieve_attn.cli import main as sieve_main
from sieve_attn.train.checkpoint import load_checkpoint
from sieve_attn.train.distributed import Distributed, fsdp_plugin, local_share
from sieve_attn.train.retrofit import RetrofitSettings, retrofit

try:
    from tests.models import VOCAB, threads, tiny_model
    from tests.train.distributed_worker import composed, windows
except ImportError:  # pytest run from another directory: tests/ itself is on sys.path
    from models import VOCAB, threads, tiny_model
    from train.distributed_worker import composed, windows

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH_TIMEOUT_S = 300  # a hung collective must fail the test, not stall CI
SETTINGS = dict(steps=6, batch_size=4, lr=1e-2, warmup=1, seed=3, checkpoint_every=3)
FSDP = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--fsdp_cpu_ram_efficient_loading", "true",
        "--fsdp_activation_checkpointing", "true"]
REPLICATED = ["--multi_gpu"]
CLI_WINDOWS = 5  # windows of the CLI's training text: fewer than either run asks for, so both get the same ones
CLI_ARGS = ["--context", "32", "--batch-size", "2", "--num-groups", "4", "--window", "4", "--top-k", "2",
            "--threads", "1", "--seed", "5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: list[str], script: list[str], home: Path) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``script`` on 2 CPU processes. ``home`` keeps any user accelerate config out; GPUs are
    hidden, as FSDP would put its device mesh on them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()), *script]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def _ok(launch) -> subprocess.CompletedProcess:
    """Runs ``launch()`` and asserts it succeeded. One failed launch is retried: on a loaded 2-core machine a
    gloo rendezvous aborted once in about 30 launches, before any training step. A deterministic failure still
    fails twice; a retried resume continues from the newest checkpoint, which resume makes exact."""
    run = launch()
    if run.returncode != 0:
        run = launch()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run


def _worker(out: Path, home: Path, *extra: str) -> subprocess.CompletedProcess:
    return _launch(REPLICATED, [str(WORKER), str(out), json.dumps(SETTINGS), *extra], home)


def _history(out: Path) -> list[tuple[int, float]]:
    return load_checkpoint(out / "checkpoint.pt")["history"]


def _adapter_tensors(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "adapter" / "adapter.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _assert_same_training(out: Path, reference: Path) -> None:
    got, want = _history(out), _history(reference)
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-5, abs=0)
    a, b = _adapter_tensors(out), _adapter_tensors(reference)
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


def _assert_same_adapter_format(out: Path, reference: Path) -> None:
    """Same files, tensor names, shapes and dtypes, and the same adapter_config.json."""
    folder, ref = out / "adapter", reference / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in ref.iterdir())
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in _adapter_tensors(out).items()}
    assert shapes == {k: (tuple(v.shape), v.dtype) for k, v in _adapter_tensors(reference).items()}
    assert json.loads((folder / "adapter_config.json").read_text()) == \
        json.loads((ref / "adapter_config.json").read_text())


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference: the worker's training in this one process, uninterrupted, SETTINGS['steps'] steps."""
    out = tmp_path_factory.mktemp("one_process")
    with threads(1):
        retrofit(composed(), windows(), out, RetrofitSettings(**SETTINGS), progress=False)
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, home) -> Path:
    out = tmp_path_factory.mktemp("two_processes")
    _ok(lambda: _worker(out, home))
    return out


def test_two_processes_train_like_one(two_processes, one_process):
    _assert_same_training(two_processes, one_process)


def _checkpoint_layout(out: Path) -> tuple:
    """Keys, router tensor shapes and optimizer state shapes of a checkpoint: what resuming depends on."""
    state = load_checkpoint(out / "checkpoint.pt")
    optimizer = state["optimizer"]
    return (sorted(state), {k: tuple(v.shape) for k, v in state["routers"].items()},
            {i: {k: tuple(v.shape) for k, v in entry.items()} for i, entry in optimizer["state"].items()},
            [group["params"] for group in optimizer["param_groups"]])


def test_two_processes_write_the_single_process_formats(two_processes, one_process):
    _assert_same_adapter_format(two_processes, one_process)
    assert _checkpoint_layout(two_processes) == _checkpoint_layout(one_process)


def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path, home, one_process):
    """Both processes die at the start of step 4 of 6 (after the checkpoint of step 3), as with ``kill -9``; a
    second launch resumes. The checkpoint of two processes also resumes in one (its format is the same)."""
    out = tmp_path / "run"
    killed = _worker(out, home, "--die-after", "3")
    assert killed.returncode != 0
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 3
    assert not (out / "adapter").exists()
    shutil.copytree(out, tmp_path / "copy")

    _ok(lambda: _worker(out, home, "--resume"))
    _assert_same_training(out, one_process)

    with threads(1):
        retrofit(composed(), windows(), tmp_path / "copy", RetrofitSettings(**SETTINGS), resume=True, progress=False)
    _assert_same_training(tmp_path / "copy", one_process)


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory) -> tuple[Path, Path]:
    """(model folder, training text): a tiny Llama with a word-level tokenizer of its 100-token vocabulary, and the
    start of the standard library's textwrap.py holding CLI_WINDOWS windows of 32 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli_model")
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.WordLevelTrainer(vocab_size=VOCAB,
                                                                    special_tokens=["[UNK]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(root)
    tiny_model("llama", seed=0).save_pretrained(root)
    tokens = CLI_WINDOWS * 32 + 10  # with the EOS appended: CLI_WINDOWS whole windows and a dropped tail
    train = root / "train.txt"
    train.write_text(text[: tokenizer.encode(text).offsets[tokens][0]])
    return root, train


def test_cli_under_accelerate_launch_with_fsdp_resumes_across_a_restart(tmp_path, home, cli_model):
    """``sieve retrofit`` on 2 processes with the base sharded by FSDP2: 3 steps, then a second launch with
    ``--steps 6 --resume``, equals one plain process running 6 steps (all 6 in warm-up, so the learning rates of the
    two schedules agree)."""
    model, train = cli_model
    common = ["--model", str(model), "--train-text", str(train), *CLI_ARGS]
    out = tmp_path / "fsdp"
    first = _ok(lambda: _launch(FSDP, ["-m", "sieve_attn.cli", "retrofit", *common, "--steps", "3", "--out",
                                         str(out)], home))
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 3
    second = _ok(lambda: _launch(FSDP, ["-m", "sieve_attn.cli", "retrofit", *common, "--steps", "6", "--resume",
                                          "--out", str(out)], home))
    assert [run.stdout.count("adapter saved to") for run in (first, second)] == [1, 1]  # rank 0 alone prints

    reference = tmp_path / "one"
    with threads(1):
        assert sieve_main(["retrofit", *common, "--steps", "6", "--out", str(reference)]) == 0
    _assert_same_training(out, reference)
    _assert_same_adapter_format(out, reference)


def test_batch_size_must_split_evenly_over_the_processes():
    assert [local_share(6, rank, 3) for rank in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    with pytest.raises(ValueError, match="batch_size: expected a multiple of the 2 processes.*got 3"):
        local_share(3, 0, 2)


def test_fsdp_version_1_is_refused():
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    with pytest.raises(ValueError, match="fsdp_version: expected 2"):
        fsdp_plugin(accelerator)


def test_causal_train_routing_is_refused_on_several_processes():
    """Causal routing uses the group biases in the forward that updates them: on several processes each would use
    biases of its own share of the batch (measured: losses 8e-3 apart after 6 steps), so it is refused."""
    model = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4, top_k=2, train_routing="causal"))
    two_ranks = SimpleNamespace(is_main_process=True, num_processes=2, process_index=0)
    with pytest.raises(ValueError, match="train_routing: expected 'sinkhorn' when training on several processes"):
        Distributed(two_ranks, batch_size=2).place(model)
