"""SFA conversion of SmolLM2-135M by fine-tuning: held-out perplexity against a plain dense fine-tune, and the sweep
of the output-matching weight lambda.

Every configuration is one `sieve finetune` run (the same data, steps and learning rate; only --method, --topk and
--matching-weight differ) in its own folder under --out. A configuration whose result.json exists is not run again,
and one interrupted after a checkpoint continues from it (--resume), so an interrupted sweep resumes. With
--gpus 0,1 the runs are spread over the GPUs, one at a time per GPU. Writes sweep.json (one row per configuration:
PPL before and after, seconds, and the kept step of an early-stopped run) and sweep.png (PPL after against
lambda). Early stopping (every run keeps its best weights on held-back training files) goes in the common
arguments: ``-- ... --validate-every 50 --validation-windows 16``. Distillation from the dense fine-tune: run the
dense configuration first, then the others with ``-- ... --teacher OUT/dense/model.safetensors`` (the rows and the
plot mark distilled runs; `results/sfa_finetune_h200/distill/call_2.sh` does both).

    python benchmarks/sfa_finetune_sweep.py --out runs/sfa_sweep --gpus 0 -- --context 1024 --steps 300
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

def _sfa(topk: int, weight: float, basis: str, warmup: int = 0) -> list[str]:
    return ["--method", "sfa", "--topk", str(topk), "--matching-weight", f"{weight:g}",
            "--feature-map", "pca" if "pca" in basis else "none",
            "--selection", "importance" if "imp" in basis else "magnitude",
            *(["--topk-warmup", str(warmup)] if warmup else [])]


# Names without "pca" keep q and k in their own coordinates (--feature-map none), as every run before the feature
# maps did; "pca" runs start from the calibrated principal axes (the default of `sieve finetune`); "imp" runs rank
# the coordinates by importance (--selection importance), the others by magnitude (--selection magnitude, passed
# explicitly since `sieve finetune` defaults to importance, so the older names keep their meaning).
BASES = ("", "pca-", "pca-imp-")
CONFIGS = {
    "dense": ["--method", "dense"],
    **{f"k{k}-{basis}l{weight:g}": _sfa(k, weight, basis)
       for basis in BASES for k in (16, 8) for weight in (1, 0, 10, 0.1)},
    # Gradual sparsification: top-k falls from the head dim over the first 100, 200 or 300 steps.
    **{f"k{k}-{basis}l{weight:g}-warm{warmup}": _sfa(k, weight, basis, warmup)
       for basis in BASES for k in (16, 8) for weight in (1, 0, 10, 0.1) for warmup in (100, 200, 300)},
}


def run_all(names: list[str], gpus: list[str], common: list[str], out: Path) -> None:
    """Runs the configurations not yet done, one subprocess per configuration, one at a time on each GPU."""
    todo: queue.Queue = queue.Queue()
    for name in names:
        if not (out / name / "result.json").is_file():
            todo.put(name)

    def worker(gpu: str):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu) if gpu else dict(os.environ)
        while True:
            try:
                name = todo.get_nowait()
            except queue.Empty:
                return
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            args = [sys.executable, "-m", "sieve_attn.cli", "finetune", *CONFIGS[name], *common, "--out", str(folder)]
            if (folder / "checkpoint.pt").is_file():  # an interrupted run continues from its last checkpoint
                args.append("--resume")
            with open(folder / "log.txt", "w") as log:
                done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"{name} on GPU {gpu or '-'}: exit {done.returncode}", flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def collect(names: list[str], out: Path) -> list[dict]:
    """One row per configuration of ``names`` done under ``out``, and the dense fine-tune's wherever it is done there
    (the baseline every ratio divides by, also when an earlier invocation ran it, as the teacher of these)."""
    rows = []
    for name in dict.fromkeys([*names, "dense"]):
        path = out / name / "result.json"
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        rows.append({"name": name, "method": result["method"], "topk": result["topk"],
                     "feature_map": result.get("feature_map") or ("none" if result["method"] == "sfa" else None),
                     "selection": result.get("selection") or ("magnitude" if result["method"] == "sfa" else None),
                     "matching_weight": result["settings"]["matching_weight"] if result["method"] == "sfa" else None,
                     "ppl_before": result["ppl_before"], "ppl_after": result["ppl_after"],
                     "tokens": result["tokens"], "seconds": result["seconds"], "settings": result["settings"],
                     "best_step": result.get("best_step"), "teacher": result.get("teacher")})
    dense = next((r["ppl_after"] for r in rows if r["method"] == "dense"), None)
    for row in rows:
        row["vs_dense_finetune"] = None if dense is None else row["ppl_after"] / dense
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sfa = [r for r in rows if r["method"] == "sfa"]
    # lambda = 0 sits at the left edge of a log axis: plotted at a tenth of the smallest positive weight
    smallest = min((r["matching_weight"] for r in sfa if r["matching_weight"] > 0), default=1.0)
    def curve(r):
        return (r["topk"], r["feature_map"], r["selection"], r["settings"].get("topk_warmup", 0),
                r.get("teacher") is not None)

    for topk, basis, selection, warm, distilled in sorted({curve(r) for r in sfa}):
        points = sorted((r["matching_weight"] or smallest / 10, r["ppl_after"]) for r in sfa
                        if curve(r) == (topk, basis, selection, warm, distilled))
        label = (f"SFA k={topk}" + (", PCA map" if basis == "pca" else "")
                 + (", importance" if selection == "importance" else "")
                 + (f", top-k warm-up {warm}" if warm else "") + (", distilled" if distilled else ""))
        ax.plot([w for w, _ in points], [p for _, p in points], ("o-" if not warm else "*-") if basis == "pca"
                else ("o--" if not warm else "*"), label=label)
    for row in rows:
        if row["method"] == "dense":
            ax.axhline(row["ppl_after"], color="k", ls="--", label="dense fine-tune")
            ax.axhline(1.05 * row["ppl_after"], color="k", ls=":", label="dense fine-tune + 5%")
    ax.set_xscale("log")
    ax.set_xlabel("matching weight lambda (0 drawn at the left)")
    ax.set_ylabel("held-out perplexity after fine-tuning")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--gpus", default="", help="comma list of GPU indices to spread the runs over ('': no GPU)")
    parser.add_argument("common", nargs=argparse.REMAINDER, help="after --: options every `sieve finetune` gets")
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    common = [a for a in args.common if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    run_all(names, args.gpus.split(",") if args.gpus else [""], common, args.out)
    rows = collect(names, args.out)
    (args.out / "sweep.json").write_text(json.dumps({"common": common, "rows": rows}, indent=1))
    if rows:
        plot(rows, args.out / "sweep.png")
    for row in rows:
        name = row["name"] + (" (distilled)" if row["teacher"] else "")
        print(f"{name:>30}  PPL {row['ppl_before']:9.3f} -> {row['ppl_after']:8.3f}  "
              f"x dense fine-tune {row['vs_dense_finetune'] or float('nan'):.3f}  {row['seconds']} s"
              + ("" if row["best_step"] is None else f"  (best step {row['best_step']})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
