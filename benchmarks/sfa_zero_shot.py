"""Zero-shot SFA conversion of SmolLM2-135M: held-out perplexity right after calibration, before any training, for
each way of choosing the top-k (no map or the calibrated principal axes; magnitude or importance selection).

What `sieve finetune --method sfa` starts from: the same held-out windows (the standard library's held-out files)
and calibration on the first --calibration-windows training windows in file order (finetune takes them after
holding back its validation files, so its figures differ slightly). Runs on the CPU in about 20 minutes at the
defaults. Writes OUT/zero_shot.json (rows: topk, feature_map, selection, ppl) and OUT/zero_shot.png.

    python benchmarks/sfa_zero_shot.py --out benchmarks/results/sfa_zero_shot_cpu
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

import sieve_attn as sa
from sieve_attn.cli import _windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn._provenance import environment
from sieve_attn.eval.report import write_json
from sieve_attn.models import load_model


def score(model, held_out, label: str) -> float:
    started = time.time()
    ppl = perplexity(model, held_out, desc=label)["ppl"]
    print(f"{label}: PPL {ppl:.3f} ({time.time() - started:.0f} s)", flush=True)
    return ppl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topk", default="16,8", help="comma-separated top-k values (16,8)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--calibration-windows", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    model, tokenizer = load_model(device=args.device)
    held_out = _windows(tokenizer, None, 1, args.context, args.eval_windows)
    calibration = _windows(tokenizer, None, 0, args.context, args.calibration_windows)
    rows = [{"topk": None, "feature_map": None, "selection": None, "ppl": score(model, held_out, "dense")}]
    for topk, feature_map, selection in itertools.product(
            [int(k) for k in args.topk.split(",")], (False, True), ("magnitude", "importance")):
        model, _ = load_model(device=args.device)
        sa.compose(model, sa.SFAConfig(topk=topk, feature_map=feature_map, selection=selection))
        if feature_map or selection == "importance":
            sa.calibrate_feature_maps(model, calibration)
        label = f"k={topk}, {'PCA map' if feature_map else 'no map'}, {selection}"
        rows.append({"topk": topk, "feature_map": feature_map, "selection": selection,
                     "ppl": score(model, held_out, label)})
    args.out.mkdir(parents=True, exist_ok=True)
    write_json({"model": "SmolLM2-135M", "context": args.context, "held_out_windows": len(held_out),
                "calibration_windows": len(calibration), "rows": rows, "environment": environment(args.device)},
               args.out / "zero_shot.json")
    plot(rows, args.out / "zero_shot.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sparse = [r for r in rows if r["topk"] is not None]
    labels = [f"k={r['topk']}\n{'PCA' if r['feature_map'] else 'no map'}\n{r['selection']}" for r in sparse]
    fig, ax = plt.subplots(figsize=(1.1 * len(sparse) + 2, 4))
    ax.bar(range(len(sparse)), [r["ppl"] for r in sparse],
           color=["tab:orange" if r["selection"] == "importance" else "tab:blue" for r in sparse])
    ax.axhline(rows[0]["ppl"], color="k", ls="--", label=f"dense ({rows[0]['ppl']:.2f})")
    ax.set_xticks(range(len(sparse)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("held-out perplexity, zero-shot")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
