"""Device probe (v10, session 26; not a library file): `sieve bench sfa`'s own decode rows (sieve_attn.bench.sfa:
decode_rows, with the bench's gate, capture and timing) run REPEAT times in one process at 128K, D=128, k=16 and 8,
to see whether the bench's figure depends on being the first run (the bench reported 0.106 ms at k=16 in sessions
25 and 26, where hot interleaved probes of the same kernel gave 0.097-0.099). Usage: python bench_repeat.py OUT."""
import argparse
import json
import os
import sys

from sieve_attn.bench import sfa

parser = argparse.ArgumentParser()
sfa.add_arguments(parser)
args = parser.parse_args(["--lengths", "", "--head-dims", "128", "--topk", "16,8", "--decode-lengths", "128K",
                          "--reps", "10", "--skip-nan-checks", "--cuda-graphs"])
bench = sfa.Bench(sfa.config_from_args(args))
rows = []
for repeat in range(int(os.environ.get("REPEAT", 3))):
    for row in sfa.decode_rows(bench, 131072, 128):
        rows.append(dict(repeat=repeat, topk=row["topk"], sfa_ms=row["sfa"]["ms"],
                         dense_ms=row["baselines"]["sdpa"]["ms"], speedup=row["speedup"]))
        print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(os.path.join(sys.argv[1], "bench_repeat.json"), "w"), indent=1)
