"""Session 42, call A: from a decode_probe.json, the variant whose topk = 16 median beats the step as committed
(variant "decode") by at least 1% without making topk = 8 more than 1% slower; appends its knobs to the device
copy's sieve_attn/ops/sfa/decode.py (module globals, read at each call) and prints what it chose. A variant of
the copy ``_decode_pps7`` (decode.py with 7 programs per SM, made by call_a.sh) appends that override too."""
import json
import sys
from pathlib import Path

PPS7 = "def _programs_per_sm(head_dim): return 7"
rows = [r for r in json.loads(Path(sys.argv[1]).read_text())["rows"] if "ms" in r]
ms = {(r["variant"], r["topk"]): r["ms"] for r in rows}
base16, base8 = ms[("decode", 16)], ms[("decode", 8)]
best = min((v for v, k in ms if k == 16 and v not in ("dense", "decode") and (v, 8) in ms),
           key=lambda v: ms[(v, 16)], default=None)
if best is None or ms[(best, 16)] > 0.99 * base16 or ms[(best, 8)] > 1.01 * base8:
    print(f"kept the committed knobs (decode {base16:.4f} / {base8:.4f} ms; best other {best})")
    sys.exit(0)
module_name, _, knob_text = best.partition(":")
knobs = list(filter(None, knob_text.split(";")))
if module_name == "_decode_pps7":
    knobs.insert(0, PPS7)
with open("sieve_attn/ops/sfa/decode.py", "a") as module:
    module.write("\n# session 42 call A's pick\n" + "".join(f"{k}\n" for k in knobs))
print(f"chose {best}: {ms[(best, 16)]:.4f} / {ms[(best, 8)]:.4f} ms against {base16:.4f} / {base8:.4f}")
