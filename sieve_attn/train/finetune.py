"""Fine-tuning the weights of a model: SFA conversion of a dense model (the paper's Eq. 8), or a plain dense
fine-tune on the same data as its baseline; optionally with early stopping on validation windows (the best weights
kept in ``best-STEP.safetensors``, the run ending with them).

Loss = LM loss + ``matching_weight`` * the mean over SFA layers of mean((O_sfa - stopgrad(O_dense))^2), where each
layer's dense output is computed from the same q, k, v (:class:`~sieve_attn.nn.sfa_layer.SFALayer`), + with a
teacher ``distill_weight`` * the per-token KL(teacher || model) (:func:`distillation_loss`; not in the paper:
docs/decisions.md, decision 10). The paper does not report its matching weight, hence the
sweep in docs/results.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .._checks import check_int, check_real, check_tensors_fit, fail
from .._files import atomic_write, read_safetensors
from ..integrations.transformers import LAYER_ATTR, SFA_ATTR, composed_configs, head_dim, sfa_layers
from . import distributed, loop
from .checkpoint import layout_digest, tensors_digest

WEIGHTS = "model.safetensors"
# Every trained tensor (SFA feature maps included) after the best validation of a validated fine-tune, by step:
# "best-{step}.safetensors".
BEST_WEIGHTS = "best-{}.safetensors"
# The module name activation checkpointing (torch's checkpoint_wrapper, which accelerate's FSDP2 routine applies)
# inserts into parameter names; state dicts, and so the files written here, leave it out.
_CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"


@dataclass
class FinetuneSettings(loop.TrainSettings):
    """``matching_weight``: the weight of the output-matching term. ``topk_warmup``: steps over which SFA's top-k
    falls from the head dim (dense) to its configured value (:func:`topk_at`); 0 starts at the configured value. A
    run no longer than its warm-up never trains at the configured top-k, though the layers end at it (a first part
    of a run lengthened on resume may be).
    ``mixed_precision``: "no" (every training forward in the weights' dtype) or "bf16" (the training forwards under
    ``torch.autocast`` to bfloat16: matrix products and attention in bfloat16, the weights, their gradients and the
    optimizer state stay in their dtype; a teacher's forwards too); validation and evaluation always run in the
    weights' dtype.
    ``distill_weight``: the weight of the distillation term (:func:`distillation_loss`) against the ``teacher``
    that :func:`finetune` then needs; 0: none. ``sparsity_weight``: the weight of the residual-energy term, the
    mean over SFA layers of the energy fraction their top-k drops from q and k
    (:func:`sieve_attn.nn.sfa_layer.residual_energy`); 0: none."""

    matching_weight: float = 1.0
    topk_warmup: int = 0
    mixed_precision: str = "no"
    distill_weight: float = 0.0
    sparsity_weight: float = 0.0

    def check(self, processes: int = 1) -> None:
        """:meth:`loop.TrainSettings.check`, and the weights numbers >= 0, ``topk_warmup`` an int >= 0 and
        ``mixed_precision`` one of :data:`MIXED_PRECISION`."""
        super().check(processes)
        for name in ("matching_weight", "distill_weight", "sparsity_weight"):
            setattr(self, name, check_real(name, getattr(self, name), lambda x: 0 <= x < math.inf,
                                           "a finite number >= 0"))
        self.topk_warmup = check_int("topk_warmup", self.topk_warmup, 0)
        if self.mixed_precision not in MIXED_PRECISION:
            fail("mixed_precision", f"one of {sorted(MIXED_PRECISION)}", repr(self.mixed_precision))


MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16}


def topk_at(step: int, topk: int, dim: int, warmup: int) -> int:
    """SFA's top-k at 0-based ``step`` of a fine-tune whose top-k warms up over ``warmup`` steps: geometrically from
    the head dim ``dim`` at step 0 to ``topk`` at step ``warmup`` and after (the fraction of coordinates kept
    shrinks by the same factor every step), rounded to the nearest int."""
    if step >= warmup:
        return topk
    return max(topk, min(dim, round(dim * (topk / dim) ** (step / warmup))))


def _set_topk(layers: list, step: int, warmup: int, dim: int) -> None:
    for layer in layers:
        layer.topk = topk_at(step, layer.config.topk, dim, warmup)


def trained_parameters(model) -> dict[str, torch.nn.Parameter]:
    """What fine-tuning trains: the model's own weights and the SFA feature maps (not Focus routers), by their names
    in the model's state dict (without the wrapper that activation checkpointing inserts), in the order of
    ``model.named_parameters()``."""
    return {name.replace(_CHECKPOINT_WRAPPER, ""): p for name, p in model.named_parameters()
            if f".{LAYER_ATTR}." not in name}


def fixed_tensors(model) -> dict[str, torch.Tensor]:
    """What compose added that fine-tuning keeps as it is but a checkpoint must carry: the SFA layers' selection
    weights (buffers, set by calibration), named as :func:`trained_parameters` names."""
    return {name.replace(_CHECKPOINT_WRAPPER, ""): t for name, t in model.named_buffers()
            if f".{SFA_ATTR}." in name and name.endswith(".selection_weights")}


def teacher_digest(teacher) -> str | None:
    """"sha256:HEX" of a teacher's state dict (names, shapes, dtypes and bytes, in order), which a resumed
    distillation must share; None without a teacher."""
    return None if teacher is None else tensors_digest(teacher.state_dict())


def own_weights(params: dict) -> dict:
    """The entries of ``params`` (named as in the state dict) that are the model's own weights, not what compose
    added: what ``model.safetensors`` holds (the SFA feature maps go with the adapter)."""
    return {name: p for name, p in params.items() if f".{SFA_ATTR}." not in name}


def _recorded_mean(layers, name: str) -> torch.Tensor | None:
    """The mean of the terms (``name``: "matching_terms" or "sparsity_terms") the SFA ``layers`` recorded since
    they were last cleared (None without any)."""
    terms = [t for layer in layers for t in getattr(layer, name)]
    return torch.stack(terms).mean() if terms else None


def _clear(layers) -> None:
    for layer in layers:
        layer.matching_terms.clear()
        layer.sparsity_terms.clear()


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The mean over token positions of KL(teacher || student) between the next-token distributions of logits
    [B, T, V] (computed in float32; no gradient flows to the teacher's logits)."""
    student = student_logits.float().log_softmax(-1).flatten(0, -2)
    teacher = teacher_logits.detach().float().log_softmax(-1).flatten(0, -2)
    return torch.nn.functional.kl_div(student, teacher, reduction="batchmean", log_target=True)


@dataclass
class Objective:
    """What a fine-tuning step minimises besides the LM loss: ``matching_weight`` times the mean matching term and
    ``sparsity_weight`` times the mean residual-energy term of the SFA ``layers`` (those of the terms they record:
    :class:`~sieve_attn.nn.sfa_layer.SFALayer`'s ``matching`` and ``sparsity``), and ``distill_weight`` times
    :func:`distillation_loss` against the frozen ``teacher`` (None: none); ``autocast_dtype`` is the dtype the
    forwards run under autocast in (None: off)."""

    layers: list
    matching_weight: float = 0.0
    teacher: torch.nn.Module | None = None
    distill_weight: float = 0.0
    autocast_dtype: torch.dtype | None = None
    sparsity_weight: float = 0.0


def _add(total, term):
    return term.detach() + (0.0 if total is None else total)


def _train_step(model, params, optimizer, objective: Objective, runtime,
                micro_batches: tuple[torch.Tensor, ...]) -> tuple:
    """One optimizer step on this process's share of a global batch, given as equal micro-batches; returns (LM
    loss, matching term or None, distillation term or None, residual-energy term or None) of the global batch."""
    optimizer.zero_grad(set_to_none=True)
    autocast = partial(torch.autocast, dtype=objective.autocast_dtype, enabled=objective.autocast_dtype is not None)
    lm_total = matching_total = distill_total = sparsity_total = None
    for batch in micro_batches:
        with autocast(batch.device.type):
            out = model(batch, labels=batch, use_cache=False)
            lm = out.loss / len(micro_batches)
            matching = _recorded_mean(objective.layers, "matching_terms")
            sparsity = _recorded_mean(objective.layers, "sparsity_terms")
            _clear(objective.layers)
            loss = lm
            if matching is not None:
                matching = matching / len(micro_batches)
                matching_total = _add(matching_total, matching)
                loss = loss + objective.matching_weight * matching
            if sparsity is not None:
                sparsity = sparsity / len(micro_batches)
                sparsity_total = _add(sparsity_total, sparsity)
                loss = loss + objective.sparsity_weight * sparsity
            if objective.teacher is not None:
                with torch.no_grad():
                    target = objective.teacher(batch, use_cache=False).logits
                distill = distillation_loss(out.logits, target) / len(micro_batches)
                distill_total = _add(distill_total, distill)
                loss = loss + objective.distill_weight * distill
        loss.backward()
        _clear(objective.layers)  # activation checkpointing runs the layers again in backward: terms again
        lm_total = _add(lm_total, lm)
    runtime.average_gradients(params)
    optimizer.step()
    return tuple(None if total is None else runtime.mean(total)
                 for total in (lm_total, matching_total, distill_total, sparsity_total))


HISTORY_VALUES = 4  # per step: LM loss, matching term, distillation term, residual-energy term


def _padded(history: list) -> list:
    """History rows with None for the values a checkpoint written before the distillation or the residual-energy
    term lacks."""
    return [tuple(row) + (None,) * (1 + HISTORY_VALUES - len(row)) for row in history]


def _gather_options():
    """Full (unsharded) state dicts on the CPU; under a process group on rank 0 alone (the other ranks get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _renumber(optimizer_state: dict, key: dict) -> dict:
    """``optimizer_state`` with each parameter key k, in "state" and in the groups' "params", replaced by key[k]:
    from the names torch.distributed.checkpoint uses to the numbers of ``Optimizer.state_dict()``, or back."""
    return {"state": {key[k]: value for k, value in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [key[k] for k in group["params"]]}
                             for group in optimizer_state["param_groups"]]}


def _weights(model, names: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of the trained weights ``names``; {} except on the main process. Every process must call
    it: FSDP2 gathers the shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(model, options=_gather_options())
    return {name: full[name] for name in names} if full else {}


def _snapshot(model, optimizer, names: list[str]) -> dict:
    """The checkpoint's {"weights", "optimizer", "fixed"} in the single-process format: full tensors, the weights
    by name, the optimizer state numbered as ``Optimizer.state_dict()`` numbers it, and :func:`fixed_tensors`. {}
    except on the main process; every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    weights = _weights(model, names)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_gather_options())
    if not weights:
        return {}
    return {"weights": weights, "optimizer": _renumber(optimizer_state, {name: i for i, name in enumerate(names)}),
            "fixed": {name: t.detach().cpu().clone() for name, t in fixed_tensors(model).items()}}


def _restore(model, optimizer, params: dict, best_dir: Path | None, state: dict) -> None:
    """Loads a checkpoint's full weights and optimizer state into ``model`` and ``optimizer``, each process taking
    its shards when FSDP2 shards them. With ``best_dir`` (a validated run) the best weights the checkpoint's
    validations name must be there: ValueError otherwise, before anything trains."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    best = loop.best_validation(state.get("validations", []))
    if best_dir is not None and best is not None and not (best_dir / BEST_WEIGHTS.format(best[0])).is_file():
        raise loop.ResumeRefused("checkpoint", f"{BEST_WEIGHTS.format(best[0])} beside it (the best weights its "
                                               f"validations name; copy it along, or resume without validation: "
                                               f"validate_every 0, `sieve finetune --validate-every 0`)",
                                 f"no such file in {best_dir}")
    fixed = fixed_tensors(model)
    saved = state.get("fixed", {})  # a checkpoint older than selection weights has none
    check_tensors_fit("checkpoint", saved, fixed, "selection weights of this model's SFA layers")
    _load_full_weights(model, params, state["weights"], "checkpoint")
    for name, tensor in saved.items():
        fixed[name].copy_(tensor)
    names = dict(enumerate(params))
    set_optimizer_state_dict(model, optimizer, _renumber(state["optimizer"], names),
                             options=StateDictOptions(full_state_dict=True))
    # Loading turns the tuples of the param groups (AdamW's betas) into lists; the checkpoints keep tuples.
    for group in optimizer.param_groups:
        group.update({key: tuple(v) for key, v in group.items() if key != "params" and isinstance(v, list)})


def _load_full_weights(model, params: dict, weights: dict, name: str) -> None:
    """Loads full tensors of the trained weights into ``model`` (each process takes its shards under FSDP2);
    ValueError naming ``name`` unless they fit ``params``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    check_tensors_fit(name, weights, params, "weights of this model")
    # strict=False: the tensors are the trained weights, not the buffers or the Focus routers.
    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True, strict=False))


def _validate(model, windows: torch.Tensor, layers: list) -> float:
    """Mean next-token NLL of ``windows`` under the model as it is (``perplexity`` runs without gradients), with
    every SFA layer at its configured top-k (what the fine-tune converges to, also during a top-k warm-up) and no
    matching terms."""
    from ..eval.perplexity import perplexity

    state = [(layer.topk, layer.matching) for layer in layers]
    for layer in layers:
        layer.topk, layer.matching = layer.config.topk, False
    try:
        return perplexity(model, windows, progress=False)["nll"]
    finally:
        for layer, (topk, matching) in zip(layers, state):
            layer.topk, layer.matching = topk, matching


def _drop_superseded_bests(out_dir: Path, validations: list, runtime) -> None:
    """Deletes the best-weights files other than the one of the best among ``validations`` (main process)."""
    best = loop.best_validation(validations)
    keep = None if best is None else BEST_WEIGHTS.format(best[0])

    def drop():
        for path in out_dir.glob(BEST_WEIGHTS.format("*")):
            if path.name != keep:
                path.unlink()

    runtime.write(drop)


def _save_weights(model, names: list[str], path: Path, runtime) -> None:
    """Writes the full trained weights to ``path`` (safetensors, atomically, by the main process); every process
    must call it (FSDP2 gathers the shards)."""
    tensors = {name: t.contiguous() for name, t in _weights(model, names).items()}
    runtime.write(lambda: atomic_write(path, lambda tmp: save_file(tensors, tmp)))


def finetune(model, windows: torch.Tensor, out_dir, settings: FinetuneSettings | None = None, *,
             validation: torch.Tensor | None = None, teacher: torch.nn.Module | None = None, resume: bool = False,
             progress: bool = True, init: str | None = None, calibration: str | None = None) -> dict:
    """Trains every weight of ``model`` (plain, or composed with an SFAConfig, whose feature maps it trains too) on
    token windows [N, T].

    AdamW (no weight decay), linear warm-up then cosine decay to a tenth (as retrofit); the model runs in eval mode
    (no dropout). With SFA layers and ``matching_weight`` > 0 the output-matching term is added. Every
    ``checkpoint_every`` steps and at the end ``out_dir/checkpoint.pt`` is written atomically (weights, optimizer,
    SFA selection weights, step, history, step times, validations); ``resume=True`` continues from it.
    ``micro_batch`` splits each process's share of a batch into micro-batches whose gradients add up (under FSDP2
    each micro-batch's backward reduce-scatters, which keeps the gradients sharded). ``topk_warmup`` > 0 lowers
    SFA's top-k step by step from the head dim to its configured value (:func:`topk_at`; gradual sparsification);
    the layers keep the configured value afterwards.
    The model's own weights go to ``out_dir/model.safetensors``; SFA feature maps (trained too) are part of what
    compose added, which :func:`sieve_attn.save_adapter` saves (``sieve finetune`` writes ``OUT/adapter``).

    Early stopping: with ``settings.validate_every`` > 0 and ``validation`` windows [M, T] (text the fine-tune does
    not train on, and not the text it is finally scored on), the model's NLL on them is measured every
    ``validate_every`` steps and after the last (:func:`_validate`: SFA at its configured top-k; the mean over
    processes), the weights after each new best go to ``out_dir/best-{step}.safetensors`` (a file is deleted once a
    checkpoint names a later best, so the one a checkpoint names survives a crash), the checkpoints record the
    validations, and at the end the model is left with the best weights (also in ``model.safetensors``). A NaN
    validation is never the best; with none better the model keeps its last weights. Every process validates on all
    the windows (a sharded model needs every process for each forward).

    Distillation: with ``settings.distill_weight`` > 0, ``teacher`` (a frozen model of the same vocabulary, e.g. the
    dense fine-tune of the same model: :func:`load_weights`) is moved to the model's device and the loss gains
    ``distill_weight`` * KL(teacher || model) per token (:func:`distillation_loss`); the teacher is not trained.

    ``init``: the digest of the weights the model started from when they are not its own (what :func:`load_weights`
    returns, e.g. for ``sieve finetune --init``; None: the model's own), which a resumed run must share.
    ``calibration``: what set the SFA layers' maps and selection weights before training, e.g. the
    :func:`~sieve_attn.train.loop.windows_digest` of the windows :func:`sieve_attn.calibrate_feature_maps` read
    (None: not calibrated), which a resumed run must share too: it restores the trained maps, and a start
    calibrated otherwise would describe another run.

    Returns {"steps", "history": [(step, lm loss, matching term or None, distillation term or None, residual-energy
    term or None)], "weights",
    "validations": [(step, NLL)],
    "best_step" (None without validation), "train_seconds" (:func:`~sieve_attn.train.loop.train_seconds`)}.

    Under a launcher of several processes (``accelerate launch``, ``torchrun``) every process calls this with the
    same arguments: each trains on its share of every global batch (``batch_size`` must be a multiple of the number of
    processes), gradients are averaged, the history holds means over processes, and rank 0 alone writes the
    checkpoints and the weights (full tensors, the single-process format) and shows progress. With an FSDP launch
    configuration the model is sharded in place (the weights, their gradients and the optimizer state); the model
    stays sharded afterwards. The rules are in :mod:`sieve_attn.train.distributed`.
    """
    settings = settings or FinetuneSettings()
    loop.check_settings(windows, settings)
    if settings.validate_every and (validation is None or validation.dim() != 2 or len(validation) == 0
                                    or validation.shape[1] != windows.shape[1]):
        fail("validation", f"token ids [M >= 1, {windows.shape[1]}] with validate_every > 0",
             None if validation is None else tuple(validation.shape))
    if (teacher is None) != (settings.distill_weight == 0):
        fail("teacher", "a model exactly when distill_weight > 0",
             f"{'none' if teacher is None else 'a model'} with distill_weight {settings.distill_weight}")
    if teacher is not None and teacher.config.vocab_size != model.config.vocab_size:
        fail("teacher", f"a model of the vocabulary size {model.config.vocab_size}", teacher.config.vocab_size)
    runtime = distributed.runtime(settings.batch_size)
    # Placing first: FSDP2 replaces the parameters by sharded ones, and gathered ones that an evaluation left in
    # their place would take requires_grad with them when resharded.
    runtime.place(model)
    params = trained_parameters(model)
    for p in params.values():
        p.requires_grad_(True)
    runtime.replicate_(params.values())
    every_layer = list(sfa_layers(model))
    layers = every_layer if settings.matching_weight > 0 or settings.sparsity_weight > 0 else []
    device = next(model.parameters()).device
    if teacher is not None:
        teacher = teacher.to(device).eval().requires_grad_(False)
    objective = Objective(layers, settings.matching_weight, teacher, settings.distill_weight,
                          MIXED_PRECISION[settings.mixed_precision], settings.sparsity_weight)
    optimizer = torch.optim.AdamW(params.values(), lr=settings.lr, weight_decay=0.0)
    out_dir = Path(out_dir)
    save = partial(_save_weights, model, list(params), runtime=runtime)
    validating = bool(settings.validate_every)
    early_stopping = {} if not validating else dict(
        validate=partial(_validate, model, validation, every_layer),
        keep_best=lambda step: save(out_dir / BEST_WEIGHTS.format(step)),
        checkpointed=partial(_drop_superseded_bests, out_dir, runtime=runtime))
    job = loop.Job("finetune",
                   step=partial(_train_step, model, list(params.values()), optimizer, objective, runtime),
                   snapshot=partial(_snapshot, model, optimizer, list(params)),
                   restore=partial(_restore, model, optimizer, params, out_dir if validating else None),
                   begin=partial(_set_topk, every_layer, warmup=settings.topk_warmup, dim=head_dim(model)),
                   # "base": the trained tensors' names and shapes, so that another model's checkpoint is refused
                   # before it is loaded
                   identity={"model": composed_configs(model), "base": layout_digest(params),
                             "teacher": teacher_digest(teacher), "init": init, "calibration": calibration,
                             # compared only where both runs validate (a resumed run may stop validating)
                             **({} if validation is None else {"validation": loop.windows_digest(validation)})},
                   **early_stopping)
    model.eval()
    for layer in layers:
        layer.matching = settings.matching_weight > 0
        layer.sparsity = settings.sparsity_weight > 0
    try:
        history, validations, step_seconds = loop.run(job, windows, out_dir, settings, optimizer, runtime,
                                                      device=device, resume=resume, progress=progress)
    finally:
        for layer in every_layer:
            layer.matching = layer.sparsity = False
            layer.topk = layer.config.topk
        _clear(layers)
        for p in params.values():
            p.requires_grad_(False)
    best = loop.best_validation(validations)
    if best is not None:
        _load_full_weights(model, params, load_file(str(out_dir / BEST_WEIGHTS.format(best[0]))), "best weights")
    _save_weights(model, list(own_weights(params)), out_dir / WEIGHTS, runtime)
    return {"steps": settings.steps, "history": _padded(history), "weights": str(out_dir / WEIGHTS),
            "validations": validations, "best_step": None if best is None else best[0],
            "train_seconds": loop.train_seconds(step_seconds)}


def load_weights(model, path, name: str = "weights") -> str:
    """Loads fine-tuned weights written by :func:`finetune` (``model.safetensors``) into ``model`` and returns their
    digest (:func:`~sieve_attn.train.checkpoint.tensors_digest`); refuses a file whose tensors do not match the
    model's own weights in name and shape (ValueError naming ``name``)."""
    tensors = read_safetensors(path, name)
    check_tensors_fit(name, tensors, own_weights(trained_parameters(model)), "weights of this model")
    model.load_state_dict(tensors, strict=False)
    return tensors_digest(tensors)
