"""The training loop retrofit and finetune share: the order of the windows, global batches split over processes,
the learning-rate schedule, progress, atomic checkpoints and resuming from them, and validation for early stopping
(a job that validates keeps its best model).

What differs between the two (what is trained, one optimizer step, what a checkpoint holds) comes in a :class:`Job`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from .._checks import check_int, check_positive_float, fail
from . import distributed
from .checkpoint import load_checkpoint, save_checkpoint, tensors_digest
from .schedule import lr_at

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainSettings:
    """What every training loop takes. ``micro_batch``: windows per forward and backward; each process's share of a
    global batch is cut into micro-batches of this size whose gradients add up before the one optimizer step
    (gradient accumulation: the memory of a small batch, the result of the whole one). None: the whole share at
    once. ``validate_every``: steps between validations (and after the last step) for a job that validates (0:
    none)."""

    steps: int = 100
    batch_size: int = 1
    lr: float = 5e-5
    warmup: int = 10
    seed: int = 0
    checkpoint_every: int = 25
    micro_batch: int | None = None
    validate_every: int = 0

    def check(self, processes: int = 1) -> None:
        """ValueError unless ``steps``, ``batch_size`` and ``checkpoint_every`` are ints >= 1, ``micro_batch`` None
        or an int >= 1, ``warmup`` and ``validate_every`` ints >= 0, ``lr`` a finite number > 0, and the batch
        splits evenly over ``processes`` and each process's share into micro-batches. Numpy numbers are replaced by
        Python ones (the settings go to checkpoints as JSON)."""
        self.steps = check_int("steps", self.steps, 1)
        self.batch_size = check_int("batch_size", self.batch_size, 1)
        self.checkpoint_every = check_int("checkpoint_every", self.checkpoint_every, 1)
        if self.micro_batch is not None:
            self.micro_batch = check_int("micro_batch", self.micro_batch, 1)
        self.warmup = check_int("warmup", self.warmup, 0)
        self.validate_every = check_int("validate_every", self.validate_every, 0)
        self.lr = check_positive_float("lr", self.lr)
        if self.batch_size % processes:
            fail("batch_size", f"a multiple of the {processes} processes (each takes an equal share of every batch)",
                 self.batch_size)
        share = self.batch_size // processes
        if share % (self.micro_batch or share):
            fail("micro_batch", f"a divisor of each process's share of the batch ({share} windows)",
                 self.micro_batch)


@dataclass
class Job:
    """One kind of training.

    - ``name``: the progress bar's label.
    - ``step(micro_batches)``: one optimizer step on this process's share of a global batch, given as equal
      micro-batches [m, T] (the learning rate is already set); returns the values the history records for the step,
      each the value of the global batch, the loss first.
    - ``snapshot()``: the trained tensors and the optimizer state, as the checkpoint holds them besides "step",
      "history" and "settings". Every process calls it (gathering sharded tensors is collective); only the main
      process's answer is written.
    - ``restore(state)``: loads a checkpoint's ``snapshot()`` part back into the model and the optimizer; every
      process calls it, with the whole checkpoint.
    - ``begin(step)``: called before 0-based step ``step`` (after the learning rate is set), for what else follows
      a schedule; a function of the step alone, so that resuming repeats it.
    - ``validate()``: the model's loss on data it does not train on (lower is better), every
      ``settings.validate_every`` steps; None for a job that has no validation data.
    - ``keep_best(step)``: called on every process after a validation that beats every earlier one
      (:func:`is_new_best`), to keep the model as it is after ``step`` steps, e.g. by writing its weights: done
      when it returns. It must not destroy what an earlier best kept: the last checkpoint may still name that one.
    - ``checkpointed(validations)``: called on every process once a checkpoint recording ``validations`` is on
      disk, so that the job can let go of what only a superseded best needed.
    - ``identity``: what else a resumed run must share with the checkpointed one, by name, as JSON-able values
      (the composed configs of the model, a teacher's digest); checkpoints record it, and resuming refuses a
      checkpoint whose value of a name differs.
    """

    name: str
    step: Callable[[torch.Tensor], tuple]
    snapshot: Callable[[], dict]
    restore: Callable[[dict], None]
    begin: Callable[[int], None] = lambda step: None
    validate: Callable[[], float] | None = None
    keep_best: Callable[[int], None] = lambda step: None
    checkpointed: Callable[[list], None] = lambda validations: None
    identity: dict = field(default_factory=dict)


def check_settings(windows: torch.Tensor, settings: TrainSettings) -> None:
    """ValueError unless ``settings.check()`` passes for the processes of this launch and ``windows`` is token ids
    [N >= 1, T]."""
    settings.check(distributed.processes())
    if windows.dim() != 2 or len(windows) == 0:
        fail("windows", "token ids [N >= 1, T]", tuple(windows.shape))


def micro_batch_size(settings, runtime) -> int:
    """Windows per forward on this process: ``settings.micro_batch``, or its whole share of a batch when None
    (:meth:`TrainSettings.check` with the processes has checked that it divides the share)."""
    return settings.micro_batch or len(runtime.share(list(range(settings.batch_size))))


def run(job: Job, windows: torch.Tensor, out_dir, settings, optimizer, runtime, *, device, resume: bool,
        progress: bool) -> tuple[list[tuple], list[tuple], list]:
    """Trains steps 0 .. ``settings.steps`` - 1 and returns (history, validations, step seconds): one tuple (step
    number from 1, *values of ``job.step``) per step, one (step number, ``job.validate()``) per validation, and
    each step's seconds (below), from the checkpoint's first when resuming.

    Step s trains on the global batch of windows ``order[(s * batch_size + i) % N]`` for i < ``batch_size``, where
    ``order`` is a permutation of the N windows drawn from ``settings.seed``; ``runtime.share`` picks this process's
    part, which goes to ``device`` cut into micro-batches of ``settings.micro_batch`` windows (it must divide the
    share: ValueError otherwise). The learning rate follows :func:`~sieve_attn.train.schedule.lr_at`. Every
    ``settings.checkpoint_every`` steps and after the last, ``out_dir/checkpoint.pt`` is written atomically by the
    main process: {"job" (``job.name``), "step", **``job.snapshot()``, "history", "step_seconds" (this process's
    wall time of each step's forwards, backwards and update, checkpoint writing excluded; None for steps of a
    checkpoint written without them), "validations", "settings", "windows" (:func:`windows_digest`), "identity"}.
    With ``settings.validate_every`` > 0 the job validates after every ``validate_every`` steps and after the last,
    before that step's checkpoint, and ``job.keep_best`` keeps the model of each new best. ``resume=True``
    continues from that file when it exists (every process reads it); the run then equals an uninterrupted one. It
    refuses (ValueError) another job's checkpoint, another ``job.identity``, other windows, settings changed in
    more than :data:`RESUMABLE_CHANGES`, or a length the steps done cannot be continued to (:func:`_check_length`).
    """
    micro = micro_batch_size(settings, runtime)
    if settings.validate_every and job.validate is None:
        fail("validate_every", f"0 for {job.name} without validation data", settings.validate_every)
    path = Path(out_dir) / CHECKPOINT
    trained_on = windows_digest(windows)
    start, history, step_seconds, validations = (_resume(job, path, settings, trained_on) if resume
                                                 else (0, [], [], []))
    if not settings.validate_every:
        validations = []  # a run resumed without validation keeps its last weights, whatever came before
    if start:  # what a crash between the checkpoint and job.checkpointed left undone (a run may have no step left)
        job.checkpointed(validations)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(settings.seed))
    bar = tqdm(range(start, settings.steps), initial=start, total=settings.steps, desc=job.name,
               disable=not (progress and runtime.is_main))
    for step in bar:
        picks = [(step * settings.batch_size + i) % len(windows) for i in range(settings.batch_size)]
        batch = windows[order[runtime.share(picks)]].to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        job.begin(step)
        started = time.perf_counter()
        values = job.step(batch.split(micro))  # host numbers: the step has finished on the device
        step_seconds.append(time.perf_counter() - started)
        history.append((step + 1, *values))
        last = step + 1 == settings.steps
        if settings.validate_every and ((step + 1) % settings.validate_every == 0 or last):
            # The mean over processes: every process must take the same branch, keep_best may be collective.
            loss = runtime.mean(torch.tensor(job.validate(), device=device))
            if is_new_best(loss, validations):
                job.keep_best(step + 1)
            validations.append((step + 1, loss))
        bar.set_postfix(loss=f"{history[-1][1]:.3f}")
        if (step + 1) % settings.checkpoint_every == 0 or last:
            state = job.snapshot()
            runtime.write(lambda: save_checkpoint({"job": job.name, "step": step + 1, **state, "history": history,
                                                   "step_seconds": step_seconds, "validations": validations,
                                                   "settings": asdict(settings), "windows": trained_on,
                                                   "identity": job.identity}, path))
            job.checkpointed(validations)
    return history, validations, step_seconds


def train_seconds(step_seconds: list) -> float:
    """Seconds the steps of a run took, ``step_seconds`` of :func:`run` summed: a resumed run's earlier
    invocations too (their times come from the checkpoint); steps of a checkpoint that recorded none count 0."""
    return round(sum(seconds for seconds in step_seconds if seconds is not None), 1)


def is_new_best(loss: float, validations: list[tuple]) -> bool:
    """Whether ``loss`` is below every earlier validation loss; a NaN loss never is, and NaN ones are not compared."""
    return not math.isnan(loss) and all(loss < earlier for _, earlier in validations if not math.isnan(earlier))


def best_validation(validations: list[tuple]) -> tuple | None:
    """The (step, loss) that :func:`is_new_best` kept last: the lowest loss, the earliest among equals, NaN never;
    None without one."""
    kept = None
    for step, loss in validations:
        if is_new_best(loss, [] if kept is None else [kept]):
            kept = (step, loss)
    return kept


# Settings a resumed run may change: how long it runs (while that leaves the learning rates of the steps done as they
# were: _check_length) and how it checkpoints, validates and splits its batches. Any
# other change of the settings (learning rate, batch, seed, the loss's weights, precision) would make the run
# neither the one checkpointed nor a fresh one, so resuming refuses it, as it refuses another Job.identity (a model
# composed otherwise, another teacher) and other windows.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "validate_every", "micro_batch")


def windows_digest(windows: torch.Tensor) -> str:
    """"N x T sha256:HEX" of token windows [N, T]: what a checkpoint records of the text it trains on."""
    return f"{windows.shape[0]} x {windows.shape[1]} {tensors_digest({'windows': windows.long()})}"


def _check_length(settings, saved_steps: int, done: int, path: Path) -> None:
    """ValueError unless a run of ``settings.steps`` can continue a checkpoint of a ``saved_steps``-step run after
    ``done`` steps as if it had run uninterrupted: no fewer steps than done, and the learning rates of the steps
    done the same under both lengths (:func:`~sieve_attn.train.schedule.lr_at`'s cosine decay spans the run, so
    a run may be lengthened or shortened only while every step done was in warm-up)."""
    if done > settings.steps:
        fail("steps", f"at least the {done} steps {path} has trained", settings.steps)
    before = replace(settings, steps=saved_steps)
    if any(lr_at(step, before) != lr_at(step, settings) for step in range(done)):
        fail("steps", f"{saved_steps}, the value in {path}, or a length under which its {done} steps have the "
                      f"learning rates they were trained with (change the length only within the warm-up of "
                      f"{settings.warmup} steps)", settings.steps)


def _check_settings_continue(state: dict, settings, path: Path) -> None:
    """ValueError unless ``settings`` may continue the checkpoint ``state`` (read from ``path``): the same values
    outside :data:`RESUMABLE_CHANGES`, and a length its steps can be continued to (:func:`_check_length`)."""
    saved = state.get("settings", {})
    for name, value in asdict(settings).items():
        if name not in RESUMABLE_CHANGES and name in saved and saved[name] != value:
            fail(name, f"{saved[name]!r}, the value in {path} (a resumed run may change only "
                       f"{', '.join(RESUMABLE_CHANGES)}; start a new run in another directory to change it)", value)
    _check_length(settings, saved.get("steps", settings.steps), state["step"], path)


class ResumeRefused(ValueError):
    """A checkpoint the run cannot continue: ``name`` (an entry of the job's identity, or "windows") differs, or
    ("checkpoint") a file the checkpoint needs is missing.
    A ValueError worded as :func:`~sieve_attn._checks.fail` words it; the commands name their option for it."""

    def __init__(self, name: str, expected: str, got):
        super().__init__(f"{name}: expected {expected}, got {got}")
        self.name = name


def check_resume_settings(out_dir, settings, job_name: str, model: Optional[dict] = None) -> None:
    """ValueError when the checkpoint in ``out_dir`` (none: nothing to check) is another job's than
    ``job_name``, cannot be continued with ``settings``, or (given ``model``, the job identity's "model": the
    methods' configs, :func:`~sieve_attn.integrations.transformers.trained_configs`) trained other methods or
    other settings of them: what resuming would refuse, told before a model loads, naming the method ("method")
    or the setting that differs. The rest of the identity and the text are checked when the run resumes."""
    path = Path(out_dir) / CHECKPOINT
    state = load_checkpoint(path)
    if state is None:
        return
    if state.get("job", job_name) != job_name:
        fail("out_dir", f"a folder whose checkpoint a {job_name} run wrote", f"{path}, written by {state['job']}")
    _check_settings_continue(state, settings, path)
    recorded = state.get("identity", {}).get("model")
    if model is None or recorded is None:
        return
    for method, config in model.items():
        trained = recorded.get(method)
        if (trained is None) != (config is None):
            fail("method", f"{'no ' if trained is None else ''}{method}, what {path} was trained with",
                 f"{'no ' if config is None else ''}{method}")
        for name in sorted(set(trained or {}) | set(config or {})):
            if trained.get(name) != config.get(name):
                fail(name, f"{trained.get(name)!r}, what {path} was trained with", repr(config.get(name)))


def _resume(job: Job, path: Path, settings, trained_on: str) -> tuple[int, list, list, list]:
    """(first step to train, history, step seconds and validations so far) from the checkpoint at ``path``, its
    state restored; (0, [], [], []) without one. ValueError, before anything is restored, when the job's
    ``identity`` or the windows' :func:`windows_digest` ``trained_on`` is not the checkpoint's, or
    ``settings`` differs from the checkpoint's in a field outside :data:`RESUMABLE_CHANGES` (what a checkpoint
    written by an older version does not record is not compared)."""
    state = load_checkpoint(path)
    if state is None:
        return 0, [], [], []
    if state.get("job", job.name) != job.name:
        fail("out_dir", f"a folder whose checkpoint a {job.name} run wrote", f"{path}, written by {state['job']}")
    identity = state.get("identity", {})
    for name, value in job.identity.items():
        if name in identity and identity[name] != value:
            raise ResumeRefused(name, f"{identity[name]!r}, what {path} was trained with", repr(value))
    if state.get("windows", trained_on) != trained_on:
        raise ResumeRefused("windows", f"the token windows {path} trained on ({state['windows']}: the same text, "
                                       f"context and number of windows; the sieve commands take --steps x "
                                       f"--batch-size of them)", trained_on)
    _check_settings_continue(state, settings, path)
    job.restore(state)
    return (state["step"], state["history"], state.get("step_seconds", [None] * state["step"]),
            state.get("validations", []))
