"""Seconds per `sieve finetune` step on a randomly initialised model of SmolLM2-135M's shape (no weights needed), for
the dense baseline and SFA, in float32 (TF32 matmuls off and on) and with bf16 autocast.

Each configuration runs ``finetune`` itself for --steps steps (batch and context as given) and reports the median of
its step times after the first --warm-steps (the loop records each step's forwards, backwards and update in the
checkpoint). Writes one JSON object to --out: {"environment", "batch_size", "context", "rows": [{"method",
"precision", "tf32_matmul", "seconds_per_step", "tokens_per_second"}]} (the environment's TF32 flag is the one before
the runs). Random weights give the same kernels and shapes as the real
model; only SFA's data-dependent work (which coordinates the top-k keeps) differs.

    python benchmarks/finetune_step_time.py --out step_time.json --device cuda
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import sieve_attn as sa
from sieve_attn._provenance import environment
from sieve_attn.train.checkpoint import load_checkpoint
from sieve_attn.train.finetune import FinetuneSettings, finetune
from sieve_attn.train.loop import CHECKPOINT

# SmolLM2-135M's architecture (its GGUF's metadata): 30 layers, 9 query and 3 KV heads of 64, tied embeddings.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
# (label, TF32 matmuls, FinetuneSettings.mixed_precision)
PRECISIONS = [("float32", False, "no"), ("tf32", True, "no"), ("bf16-autocast", False, "bf16")]


def _model(method: str, device: str, topk: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device)
    if method == "sfa":
        sa.compose(model, sa.SFAConfig(topk=topk, backend="sdpa" if device == "cuda" else "auto", feature_map=True))
    return model


def time_steps(method: str, precision: tuple, args) -> dict:
    label, tf32, mixed = precision
    torch.backends.cuda.matmul.allow_tf32 = tf32
    model = _model(method, args.device, args.topk)
    windows = torch.randint(0, SMOLLM2_135M["vocab_size"], (args.steps * args.batch_size, args.context))
    settings = FinetuneSettings(steps=args.steps, batch_size=args.batch_size, lr=1e-4, warmup=1,
                                checkpoint_every=args.steps, mixed_precision=mixed, matching_weight=1.0)
    with tempfile.TemporaryDirectory() as out:
        finetune(model, windows, out, settings, progress=False)
        seconds = load_checkpoint(Path(out) / CHECKPOINT)["step_seconds"][args.warm_steps:]
    median = statistics.median(seconds)
    row = {"method": method, "precision": label, "tf32_matmul": tf32, "seconds_per_step": median,
           "tokens_per_second": args.batch_size * args.context / median, "steps_timed": len(seconds)}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warm-steps", type=int, default=4, help="first steps left out of the median (4)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=16)
    args = parser.parse_args()
    if not 0 <= args.warm_steps < args.steps:
        parser.error(f"--warm-steps: expected 0 <= it < --steps ({args.steps}), got {args.warm_steps}")
    setting = environment(args.device)  # before the rows switch TF32 on and off (each row records its own)
    rows = [time_steps(method, precision, args) for method in ("dense", "sfa") for precision in PRECISIONS]
    args.out.write_text(json.dumps({"environment": setting, "batch_size": args.batch_size,
                                    "context": args.context, "topk": args.topk, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
