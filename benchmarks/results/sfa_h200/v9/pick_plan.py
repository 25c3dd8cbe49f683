"""Picks the SFA decode plan from a probe sweep and writes it into the tree (v9 call C; not a library file).

Usage: python pick_plan.py SWEEP_JSON... -- reads the gated rows of index_words_probe.py sweeps of the tree
(kernel sfa, _NUM_STAGES x _programs_per_sm), takes the stage count whose best D=128 rows (k=8 and k=16 summed)
are fastest, and at that stage count the programs per SM fastest at D=128 and at D=64; rewrites
sieve_attn/ops/sfa/decode.py's _NUM_STAGES and _programs_per_sm to them and prints the choice. The same edit is
then made to the committed tree by hand (call C's plan.txt records it)."""
import collections
import json
import re
import sys

rows = [r for f in sys.argv[1:] for r in json.load(open(f))["rows"] if r.get("kernel") == "sfa" and r.get("ok")]
by = collections.defaultdict(dict)  # (D, stages, programs) -> {topk: ms}
for r in rows:
    by[(r["D"], r["_NUM_STAGES"], r["_programs_per_sm"])][r["topk"]] = r["ms"]
total = {key: sum(ms.values()) for key, ms in by.items() if len(ms) == 2}
stages = min({s for _, s, _ in total}, key=lambda s: min(t for (d, st, _), t in total.items() if d == 128 and st == s))
best = {d: min((t, p) for (dd, st, p), t in total.items() if dd == d and st == stages)[1] for d in (64, 128)}
path = "sieve_attn/ops/sfa/decode.py"
src = open(path).read()
src, n1 = re.subn(r"_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 32, 1, \d+", f"_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 32, 1, {stages}", src)
src, n2 = re.subn(r"return \d+ if head_dim >= 128 else \d+", f"return {best[128]} if head_dim >= 128 else {best[64]}", src)
assert n1 == n2 == 1, (n1, n2)
open(path, "w").write(src)
print(json.dumps(dict(stages=stages, programs_per_sm={"128": best[128], "64": best[64]},
                      ms={f"D{d} s{s} p{p}": by[(d, s, p)] for d, s, p in sorted(by)})))
