"""Zero-shot SFA k=16 (calibrated principal-axes maps, importance selection) on prose and on code: held-out
perplexity against dense, each text calibrated on its own kind. Prose: Vim's documentation as Debian ships it
(even-numbered files in name order calibrate, odd ones are held out); code: the standard library's split.

    PYTHONPATH=. .venv/bin/python benchmarks/results/session51/prose_probe.py [HELD_OUT_WINDOWS]
"""
import glob
import math
import sys

import torch

import sieve_attn as sa
from sieve_attn.cli import _windows
from sieve_attn.data.text import token_windows
from sieve_attn.eval.perplexity import perplexity
from sieve_attn.models import load_model

CONTEXT, CALIBRATION_WINDOWS = 1024, 16


def main(held_out_windows: int) -> None:
    torch.set_num_threads(2)
    _, tokenizer = load_model(device="cpu")
    vim = sorted(glob.glob("/usr/share/vim/vim90/doc/*.txt"))
    texts = {
        "prose": (token_windows(tokenizer, vim[0::2], CONTEXT, CALIBRATION_WINDOWS),
                  token_windows(tokenizer, vim[1::2], CONTEXT, held_out_windows)),
        "code": (_windows(tokenizer, None, 0, CONTEXT, CALIBRATION_WINDOWS),
                 _windows(tokenizer, None, 1, CONTEXT, held_out_windows)),
    }
    for name, (calibration, held_out) in texts.items():
        model, _ = load_model(device="cpu")
        dense = perplexity(model, held_out, desc="dense")["ppl"]
        sa.compose(model, sa.SFAConfig(topk=16, feature_map=True, selection="importance"))
        sa.calibrate_feature_maps(model, calibration)
        sfa = perplexity(model, held_out, desc="sfa")["ppl"]
        print(f"{name}: dense {dense:.3f} sfa16 {sfa:.3f} ratio {sfa / dense:.3f} nats {math.log(sfa / dense):.3f}",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
