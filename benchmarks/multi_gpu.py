"""Training on several GPUs against one: the same global batches, the loss curves compared, throughput measured.

For each launch (one process; N processes with the model replicated; N processes with FSDP2) the command
(`sieve retrofit` or `sieve finetune`) runs --steps steps on the same data. Throughput is global batch x context
tokens over the median step time of rank 0 after the first --warmup-steps steps (the checkpoint's "step_seconds":
model loading, kernel compilation and checkpoint writing are left out). The loss histories (from the checkpoints)
are compared step by step. Peak memory per GPU is sampled with nvidia-smi (it includes the CUDA context). Writes
multi_gpu.json to --out after each launch.

The launch "micro" is one process running each global batch as micro-batches of one GPU's share (gradient
accumulation): the same batch shapes as the N-process runs in one process. Its losses against the one-process run's
are the rounding noise of the batch shape; the N-process runs are compared with both.

    python benchmarks/multi_gpu.py --gpus 2 --batch-size 4 --out runs/multi_gpu retrofit --dtype bfloat16 --context 4096
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

FSDP = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"]


class MemorySampler:
    """Peak ``memory.used`` per GPU (MiB, nvidia-smi, every 200 ms) while the context is open."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()

    def _sample(self):
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                index, used = (int(x) for x in line.split(","))
                self.peak[index] = max(self.peak.get(index, 0), used)
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if shutil.which("nvidia-smi"):  # none on a CPU machine: nothing to sample
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def launch(processes: int, fsdp: bool) -> list[str]:
    """The command prefix that starts ``processes`` training processes."""
    if processes == 1 and not fsdp:
        return [sys.executable, "-m", "sieve_attn.cli"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
            "--mixed_precision", "no", *(FSDP if fsdp else ["--multi_gpu"]), "-m", "sieve_attn.cli"]


def run(prefix: list[str], command: list[str], steps: int, out: Path, log) -> dict:
    """Runs one training command to completion; returns its wall time, peak memory, loss history and step times."""
    out.mkdir(parents=True, exist_ok=True)
    args = [*prefix, *command, "--steps", str(steps), "--checkpoint-every", str(steps), "--out", str(out)]
    log.write(f"$ {' '.join(args)}\n")
    log.flush()
    started = time.perf_counter()
    with MemorySampler() as memory:
        done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode:
        return {"steps": steps, "failed": done.returncode}
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    return {"steps": steps, "seconds": seconds, "peak_mib": memory.peak,
            "losses": [entry[1] for entry in state["history"]], "step_seconds": state["step_seconds"]}


def compare(launches: dict) -> None:
    """Adds to each finished launch its largest loss difference to the "1" and "micro" runs, and to each launch of
    several processes its speedup and scaling efficiency over "1"."""
    finished = {name: entry for name, entry in launches.items() if "tokens_per_second" in entry}
    for name, entry in finished.items():
        for reference in ("1", "micro"):
            if reference != name and reference in finished:
                a, b = finished[reference]["run"]["losses"], entry["run"]["losses"]
                entry[f"max_loss_difference_to_{reference}"] = max(abs(x - y) for x, y in zip(a, b))
        if entry["processes"] > 1 and "1" in finished:
            entry["speedup"] = entry["tokens_per_second"] / finished["1"]["tokens_per_second"]
            entry["scaling_efficiency"] = entry["speedup"] / entry["processes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the step time (2)")
    parser.add_argument("--batch-size", type=int, default=2, help="global batch (a multiple of --gpus)")
    parser.add_argument("--launches", default="1,micro,replicated,fsdp",
                        help="comma list of 1, micro, replicated, fsdp")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run on gloo")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="`retrofit ...` or `finetune ...` with their options (not --steps/--out/--batch-size)")
    args = parser.parse_args()
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps: expected more than --warmup-steps ({args.warmup_steps}), got {args.steps}")
    command = [*args.command, "--device", args.device, "--batch-size", str(args.batch_size)]
    context = int(command[command.index("--context") + 1]) if "--context" in command else 1024
    share = ["--micro-batch", str(args.batch_size // args.gpus)]
    launches = {"1": (1, False, []), "micro": (1, False, share), "replicated": (args.gpus, False, []),
                "fsdp": (args.gpus, True, [])}
    record = {"command": command, "gpus": args.gpus, "batch_size": args.batch_size, "context": context,
              "steps": args.steps, "warmup_steps": args.warmup_steps,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "versions": {"torch": torch.__version__}, "launches": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "multi_gpu.log", "w") as log:
        for name in args.launches.split(","):
            processes, fsdp, extra = launches[name]
            result = run(launch(processes, fsdp), [*command, *extra], args.steps, args.out / name, log)
            entry = {"processes": processes, "fsdp": fsdp, "run": result}
            if "failed" not in result:
                timed = [t for t in result["step_seconds"][args.warmup_steps:] if t is not None]
                entry["median_step_seconds"] = statistics.median(timed)
                entry["tokens_per_second"] = args.batch_size * context / entry["median_step_seconds"]
            record["launches"][name] = entry
            compare(record["launches"])
            print(name, {k: v for k, v in entry.items() if k != "run"}, flush=True)
            (args.out / "multi_gpu.json").write_text(json.dumps(record, indent=1))  # after each: a cut run keeps some
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
