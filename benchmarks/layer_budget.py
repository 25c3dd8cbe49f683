"""Per-layer top-k budgets for a trained Focus adapter: which layers could stay dense for the least PPL cost.

Each layer's sensitivity is measured alone (that layer at hard top-``--sparse-top-k``, every other layer at top-K,
i.e. dense) on the last training windows, never on held-out text; then the ``n`` most sensitive layers stay dense,
the rest go sparse, and the held-out windows are scored.

    python benchmarks/layer_budget.py --adapter runs/demo/adapter --out benchmarks/results/layer_budget.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import sieve_attn as sa
from sieve_attn.data.text import stdlib_split, token_windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn._provenance import environment
from sieve_attn.integrations.transformers import focus_layers
from sieve_attn.models import load_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--sparse-top-k", type=int, default=2)
    parser.add_argument("--dense-layers", default="0,4,8,11", help="how many layers stay dense, comma list")
    parser.add_argument("--calibration-windows", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=6)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/layer_budget.json"))
    args = parser.parse_args()
    model, tokenizer = load_model()
    train, held = stdlib_split()
    calibration = token_windows(tokenizer, train, args.context)[-args.calibration_windows:]
    held_out = token_windows(tokenizer, held, args.context, args.eval_windows)
    dense = {"calibration": perplexity(model, calibration)["ppl"], "held_out": perplexity(model, held_out)["ppl"]}
    sa.load_adapter(model, args.adapter)
    layers = list(focus_layers(model))
    every_group = model.sieve_config.num_groups

    def set_budget(sparse: set[int]):
        for index, layer in enumerate(layers):
            layer.reconfigure(top_k=args.sparse_top_k if index in sparse else every_group)

    sensitivity = []
    for index in range(len(layers)):
        set_budget({index})
        sensitivity.append(perplexity(model, calibration, progress=False)["ppl"] / dense["calibration"] - 1)
    by_cost = sorted(range(len(layers)), key=sensitivity.__getitem__)
    budgets = []
    for keep_dense in (int(n) for n in args.dense_layers.split(",")):
        dense_layers = set(by_cost[len(layers) - keep_dense:]) if keep_dense else set()
        set_budget(set(range(len(layers))) - dense_layers)
        row = perplexity(model, held_out, progress=False)
        budgets.append({"dense_layers": sorted(dense_layers), "ppl": row["ppl"],
                        "vs_dense": row["ppl"] / dense["held_out"] - 1, "pairs_attended": row["pairs_attended"]})
        print(budgets[-1], flush=True)
    record = {"adapter_config": model.sieve_config.to_dict(), "dense": dense, "sensitivity": sensitivity,
              "budgets": budgets, "calibration_windows": len(calibration), "eval_windows": len(held_out),
              "environment": environment()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
