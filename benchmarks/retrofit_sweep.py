"""Router-only retrofit of SmolLM2-135M under several Focus settings: held-out perplexity, dense vs Focus.

Every configuration trains fresh routers on the standard library's training split (the frozen model is shared),
then measures, in causal mode, dense / Focus soft / Focus hard top-k perplexity on the held-out files and on the
GPL-3 text (out of domain), with the fraction of causal pairs the hard pattern attends. Results are written after
each configuration (JSON), and a plot of PPL against pairs attended at the end.

    python benchmarks/retrofit_sweep.py --out benchmarks/results/retrofit_sweep --configs base,mult
    python benchmarks/retrofit_sweep.py --windows scratch/windows1024.pt --device cuda ...

``--windows`` takes token windows prepared elsewhere (a dict of tensors "train", "held_out", "gpl3"), so a machine
with another Python (another standard library) scores the very same tokens.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import sieve_attn as sa
from sieve_attn.data.text import GPL3, stdlib_split, token_windows
from sieve_attn._provenance import environment
from sieve_attn.eval.report import evaluate_modes
from sieve_attn.models import load_model
from sieve_attn.train.retrofit import RetrofitSettings, retrofit

CONFIGS = {
    "base": {},
    "mult": {"gate": "multiplicative"},
    "w256": {"window": 256},
    "mult-w256": {"gate": "multiplicative", "window": 256},
    "k4": {"num_groups": 4},
    "k16": {"num_groups": 16},
    "nosink": {"sink_tokens": 0},
    "sink4": {"sink_tokens": 4},
    "w256-k16": {"window": 256, "num_groups": 16},
    "w256-sink4": {"window": 256, "sink_tokens": 4},
    # the soft gate trained on the causal routing it is evaluated with (decision 1's strictly causal variant)
    "w256-causal": {"window": 256, "train_routing": "causal"},
    "w256-k16-causal": {"window": 256, "num_groups": 16, "train_routing": "causal"},
    "mult-w256-causal": {"gate": "multiplicative", "window": 256, "train_routing": "causal"},
    "w384-causal": {"window": 384, "train_routing": "causal"},
    "w384-k16-causal": {"window": 384, "num_groups": 16, "train_routing": "causal"},
}


def windows(args, tokenizer) -> dict:
    if args.windows:
        return torch.load(args.windows)
    train, held = stdlib_split()
    data = {"train": token_windows(tokenizer, train, args.context),
            "held_out": token_windows(tokenizer, held, args.context)}
    if GPL3.is_file():
        data["gpl3"] = token_windows(tokenizer, [GPL3], args.context)
    return data


def hard_rows(model, data, max_top_k):
    rows = []
    for top_k in range(1, max_top_k + 1):
        sa.reconfigure(model, top_k=top_k)
        rows += [dict(row, top_k=top_k) for row in evaluate_modes(model, data, ["hard"], batch_size=8, progress=False)]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--eval-windows", type=int, default=None, help="held-out windows to score (all)")
    parser.add_argument("--max-top-k", type=int, default=4, help="hard top-k values scored: 1..this (at most K)")
    parser.add_argument("--windows", default=None, help="prepared token windows (torch file)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the routers' random start and the window order (default: a random start)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/retrofit_sweep"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # exact float32 perplexities
    base, tokenizer = load_model(args.model, device=args.device)
    data = windows(args, tokenizer)
    held_out = data["held_out"][: args.eval_windows]
    evals = {"held_out": held_out, **({"gpl3": data["gpl3"]} if "gpl3" in data else {})}
    dense = {name: evaluate_modes(base, w, ["dense"], batch_size=8, progress=False)[0] for name, w in evals.items()}
    print("dense", {k: round(v["ppl"], 4) for k, v in dense.items()}, flush=True)
    for name in args.configs.split(","):
        started = time.time()
        config = sa.FocusConfig(**CONFIGS[name])
        if args.seed is not None:
            torch.manual_seed(args.seed)  # compose draws the routers' start from torch's default generator
        model = sa.compose(copy.deepcopy(base), config)
        settings = RetrofitSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                    checkpoint_every=args.steps, seed=args.seed or 0)
        trained = retrofit(model, data["train"], args.out / "runs" / name, settings, progress=False)
        print(name, "trained in", round(time.time() - started, 1), "s; loss", trained["history"][-1], flush=True)
        record = {"config_name": name, "focus_config": config.to_dict(), "steps": args.steps, "seed": args.seed,
                  "batch_size": args.batch_size, "lr": args.lr, "context": args.context,
                  "train_tokens": args.steps * args.batch_size * args.context, "loss_history": trained["history"],
                  "router_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
        for split, w in evals.items():
            rows = [dense[split]] + evaluate_modes(model, w, ["soft"], batch_size=8, progress=False)
            rows += hard_rows(model, w, min(config.num_groups, args.max_top_k))
            record[split] = rows
            print(name, split, [(r["mode"], r.get("top_k"), round(r["ppl"], 4),
                                 None if r["pairs_attended"] is None else round(r["pairs_attended"], 4)) for r in rows],
                  flush=True)
        record["seconds"] = round(time.time() - started, 1)
        print(name, "seconds", record["seconds"], flush=True)
        record["environment"] = environment(args.device)
        (args.out / f"{name}.json").write_text(json.dumps(record, indent=2))
        del model
    plot(args.out)


def plot(folder: Path) -> None:
    """PPL change against dense (same windows) vs fraction of pairs attended, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        rows = record["held_out"]
        dense = rows[0]["ppl"]
        hard = [r for r in rows if r["mode"] == "hard"]
        config = record["focus_config"]
        label = f"{record['config_name']} (K={config['num_groups']}, w={config['window']})"
        line, = ax.plot([100 * r["pairs_attended"] for r in hard], [100 * (r["ppl"] / dense - 1) for r in hard],
                        marker="o", label=label)
        for r in hard:
            ax.annotate(str(r["top_k"]), (100 * r["pairs_attended"], 100 * (r["ppl"] / dense - 1)), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        soft = next(r for r in rows if r["mode"] == "soft")
        ax.scatter([100.0], [100 * (soft["ppl"] / dense - 1)], marker="x", color=line.get_color())
    ax.axhline(0, color="black", linestyle="--", linewidth=1, label="dense")
    ax.axvline(75, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("causal pairs attended, % (hard top-k marked on points; x at 100 = soft gate)")
    ax.set_ylabel("held-out PPL vs dense, %")
    ax.set_title("SmolLM2-135M, router-only Focus retrofit, context 1024, causal routing")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "ppl_vs_pairs.png", dpi=120)


if __name__ == "__main__":
    main()
