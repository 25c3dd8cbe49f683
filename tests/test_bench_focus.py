"""`sieve bench focus` on the CPU: end to end on tiny sizes, the correctness gate, the group generator, the
prototype baseline, the extra backends' rows and the CLI help."""
import functools
import json
import re
import time

import pytest
import torch

from sieve_attn.bench.focus import (BenchConfig, balanced_groups, check_rows, config_from_args, format_length,
                                    parse_length, prototype_same_group, run, sample_rows)
from sieve_attn.bench.timing import WARMUP_S, graphed, measure
from sieve_attn.cli import build_parser, main
from sieve_attn.ops.focus.attention import focus_attention

TINY = ["--lengths", "256,512", "--groups", "4", "--top-k", "1,2", "--head-dims", "32", "--heads", "2",
        "--decode-lengths", "512", "--decode-heads", "4/2", "--warmup", "0", "--reps", "1", "--gate-rows", "16",
        "--baselines", "cudnn,flash,prototype", "--backend", "reference", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_main_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "focus", *TINY, "--backward", "--backward-gate-length", "256", "--out", str(out)]) == 0
    record = json.loads((out / "bench_focus.json").read_text())
    assert (out / "speedup_vs_length.png").stat().st_size > 0
    assert record["settings"]["lengths"] == [256, 512] and record["settings"]["backend"] == "reference"
    assert {"device", "torch", "triton", "cuda", "cudnn", "commit", "source_digest"} <= set(record["environment"])
    rows = record["rows"]
    assert {r["mode"] for r in rows} == {"forward", "forward+backward", "decode"}
    assert len(rows) == 2 * 2 * 2 + 2  # (forward, backward) x lengths x top-k, then decode x top-k
    assert all(r["correct"] and r["focus"]["ms"] > 0 and r["focus_backend"] == "reference" for r in rows)
    # cuDNN (and the prototype, built on it) is not on the CPU: recorded as unavailable, with the reason.
    forward = rows[0]
    cudnn = forward["baselines"]["cudnn"]
    assert cudnn["ms"] is None and "No viable backend" in cudnn["reason"] and forward["speedup"]["cudnn"] is None
    assert forward["speedup"]["flash"] == pytest.approx(forward["baselines"]["flash"]["ms"] / forward["focus"]["ms"])
    decode = rows[-1]
    assert decode["T"] == 512 and decode["heads"] == 4 and decode["kv_heads"] == 2
    assert decode["baselines"]["sdpa"]["backend"] in ("flash", "efficient", "math")
    table = capsys.readouterr().out
    assert "| forward | 512 | 32 | 4 | 2 |" in table and "FAIL" not in table


def test_gate_catches_a_wrong_output(capsys):
    def wrong(q, k, v, groups):
        out = focus_attention(q, k, v, groups, window=16, backend="reference")
        out[:, :, -1] += 0.5  # the last row is always among the sampled rows
        return out

    config = BenchConfig(lengths=(128,), heads=2, head_dims=(32,), group_counts=(4,), top_ks=(1,), window=16,
                         baselines=("flash",), decode_lengths=(), warmup=0, reps=1, gate_rows=8, device="cpu")
    row, = run(config, focus_fn=wrong)
    assert row["correct"] is False and row["gate"]["worst_ratio"] > 1
    assert row["focus"]["ms"] is None and row["speedup"]["flash"] is None
    assert row["baselines"]["flash"]["ms"] is not None  # the dense baseline is still measured
    assert "FAIL" in capsys.readouterr().out


def test_gate_passes_the_reference_and_fails_a_shifted_window():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 16, dtype=torch.bfloat16) for _ in range(3))
    groups = balanced_groups(300, 4, 2)
    rows = sample_rows(300, 32, 16)
    good = focus_attention(q, k, v, groups, window=32, backend="reference")
    assert check_rows(good, q, k, v, groups, rows, 32).passed
    wider = focus_attention(q, k, v, groups, window=40, backend="reference")
    assert not check_rows(wider, q, k, v, groups, rows, 32).passed
    poisoned = good.clone()
    poisoned[0, 1, rows[3]] = float("nan")  # not the first row checked: NaN must not slip through max()
    result = check_rows(poisoned, q, k, v, groups, rows, 32)
    assert not result.passed and result.worst_ratio is None


def test_balanced_groups_adjacent_are_balanced_and_distinct():
    groups = balanced_groups(1003, 8, 3, seed=5, spread="adjacent")
    assert groups.shape == (1, 1003, 3) and groups.dtype == torch.long
    for slot in range(3):
        counts = torch.bincount(groups[0, :, slot], minlength=8)
        assert int(counts.max() - counts.min()) <= 1
    ordered = groups[0].sort(dim=-1).values
    assert bool((ordered[:, 1:] != ordered[:, :-1]).all())
    assert not torch.equal(groups, balanced_groups(1003, 8, 3, seed=6, spread="adjacent"))  # random order
    assert torch.equal((groups[0, :, 1] - groups[0, :, 0]) % 8, torch.ones(1003, dtype=torch.long))
    with pytest.raises(ValueError, match="top_k"):
        balanced_groups(10, 2, 3)


def test_balanced_groups_combinations_deal_every_set_equally():
    groups = balanced_groups(28 * 40 + 5, 8, 2, seed=3)
    assert groups.shape == (1, 1125, 2)
    assert bool((groups[0, :, 0] < groups[0, :, 1]).all())  # distinct, ascending
    sets = torch.bincount(groups[0, :, 0] * 8 + groups[0, :, 1], minlength=64)
    assert int((sets > 0).sum()) == 28 and int(sets.max() - sets[sets > 0].min()) <= 1
    sizes = torch.bincount(groups.flatten(), minlength=8)
    assert int(sizes.max() - sizes.min()) <= 7  # C(K - 1, 1) tokens at most
    assert not torch.equal(groups, balanced_groups(1125, 8, 2, seed=4))
    # one group per token: both spreads deal the same groups
    assert torch.equal(balanced_groups(77, 5, 1, seed=2), balanced_groups(77, 5, 1, seed=2, spread="adjacent"))
    with pytest.raises(ValueError, match="spread"):
        balanced_groups(10, 4, 2, spread="diagonal")
    with pytest.raises(ValueError, match="spread"):
        balanced_groups(10, 60, 30)


def test_prototype_top1_equals_focus_without_window():
    # With one group per token, same-group attention alone is Focus with window 0 (the diagonal is in-group too).
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    groups = balanced_groups(70, 3, 1)
    proto = prototype_same_group(q, k, v, groups, 3, backend="math")
    expected = focus_attention(q, k, v, groups, window=0, backend="reference")
    torch.testing.assert_close(proto[:, 0].transpose(0, 1)[None], expected, atol=1e-5, rtol=1e-5)


def test_measure_on_cpu_reports_median_within_budget():
    calls = []
    timing = measure(lambda: calls.append(1), torch.device("cpu"), warmup=0, reps=5, budget_s=10)
    assert len(calls) == 5 and timing.reps == 5 and timing.ms >= 0 and timing.peak_gb is None


def test_measure_warms_up_for_its_calls_and_at_least_warmup_s():
    """At least ``warmup`` untimed calls, and more until WARMUP_S has passed: 1 ms calls warm up for WARMUP_S (not
    much longer), 40 ms calls take just the two asked for; none at warmup 0 (the first test)."""
    for call_s, least in ((0.001, 2), (0.04, 2)):
        calls = []
        started = time.perf_counter()
        measure(lambda: calls.append(time.sleep(call_s)), torch.device("cpu"), warmup=2, reps=1, budget_s=0)
        warm = len(calls) - 1
        assert warm >= least and (warm - 1) * call_s < 3 * WARMUP_S and time.perf_counter() - started >= WARMUP_S
        if call_s > WARMUP_S:
            assert warm == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_graphed_replay_keeps_alive_what_the_graph_reads():
    """A step that alone holds its input (as the bench's decode rows hand over a freshly filled cache): after the
    caller drops it and the allocator hands out memory again, the replay still reads that input."""
    result = torch.zeros((), device="cuda")
    replay = graphed(functools.partial(lambda x: result.copy_(x.double().sum()),
                                       torch.arange(1 << 20, device="cuda", dtype=torch.float32)))
    reused = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]  # take freed blocks, if any
    replay()
    assert result.item() == (1 << 20) * ((1 << 20) - 1) / 2 and reused


def test_lengths_parse_with_units():
    assert [parse_length(t) for t in ("300", "4K", "1m")] == [300, 4096, 2 ** 20]
    assert [format_length(t) for t in (300, 4096, 2 ** 20)] == ["300", "4K", "1M"]


def test_bench_focus_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "focus", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--lengths", "--head-dims", "--groups", "--top-k", "--backend", "--backends", "--baselines",
                   "--backward", "--max-backward-length", "--decode-lengths", "--out"):
        assert option in text


def test_top_k_above_group_count_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--top-k"):
        main(["bench", "focus", "--groups", "2", "--top-k", "3", "--out", str(tmp_path)])


def test_extra_backends_add_gated_rows(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "focus", *TINY, "--lengths", "512", "--backends", "sdpa", "--decode-lengths", "",
                 "--backward", "--backward-gate-length", "256", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_focus.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # (forward, backward) x top-k, each configured then sdpa
    configured, extra = rows[::2], rows[1::2]
    assert all("extra_backend" not in r and r["focus_backend"] == "reference" for r in configured)
    assert all(r["extra_backend"] == "sdpa" and r["focus_backend"] == "sdpa" for r in extra)
    assert all(r["correct"] and r["focus"]["ms"] > 0 for r in rows)
    for mine, theirs in zip(configured, extra):  # same configuration, same baseline measurements
        assert (mine["mode"], mine["T"], mine["top_k"]) == (theirs["mode"], theirs["T"], theirs["top_k"])
        assert mine["baselines"] == theirs["baselines"]
    assert "| forward | 512 | 32 | 4 | 2 | sdpa |" in capsys.readouterr().out


def test_extra_backends_are_only_those_asked_for():
    def extra(*options):
        return config_from_args(build_parser().parse_args(["bench", "focus", *options])).extra_backends
    assert extra("--device", "cpu") == () and extra("--device", "cuda") == ()
    assert extra("--backend", "sdpa", "--backends", "sdpa") == () and extra("--backends", "sdpa,triton") == (
        "sdpa", "triton")
    with pytest.raises(SystemExit):
        extra("--backends", "cudnn")


def test_backend_used_asks_with_gradients_in_forward_backward_rows(monkeypatch):
    """auto weighs whether gradients are needed (attention.SDPA_FROM), so a forward+backward row asks about a q that
    requires them and a forward row about one that does not."""
    from sieve_attn.bench import focus as bench_focus
    seen = []
    monkeypatch.setattr(bench_focus.focus_ops, "focus_backend",
                        lambda q, k, groups, **kwargs: seen.append(q.requires_grad) or ("triton", "why"))
    bench = bench_focus.Bench(BenchConfig(device="cpu"))
    q = torch.randn(1, 2, 16, 8)
    groups = torch.zeros(1, 16, dtype=torch.long)
    for mode in ("forward", "forward+backward", "decode"):
        assert bench.backend_used(q, q, groups, mode) == ("triton", "why")
    assert seen == [False, True, False] and not q.requires_grad


def test_the_gradient_gate_checks_the_backend_the_timed_length_resolves_to(tmp_path, monkeypatch):
    """auto may pick one backend at the gate's short length (dense SDPA below 8K on CUDA) and another at the timed
    length: the gate runs the timed one, forced, and says which."""
    from sieve_attn.bench import focus as bench_focus
    resolved = {512: ("sdpa", "long enough"), 256: ("dense", "short")}
    monkeypatch.setattr(bench_focus.focus_ops, "focus_backend",
                        lambda q, k, groups, **kwargs: resolved.get(q.shape[2], ("reference", "decode")))
    gated = []
    real = bench_focus.focus_ops.focus_attention
    monkeypatch.setattr(bench_focus.focus_ops, "focus_attention",
                        lambda *a, backend, **kw: gated.append((a[0].shape[2], backend)) or real(*a, backend=backend,
                                                                                                  **kw))
    out = tmp_path / "bench"
    argv = ["bench", "focus", *TINY, "--top-k", "1", "--decode-lengths", "", "--backend", "auto", "--backward",
            "--backward-gate-length", "128", "--out", str(out)]
    assert main(argv) == 0  # the options given last (--backend, --top-k, --decode-lengths) replace TINY's
    rows = [r for r in json.loads((out / "bench_focus.json").read_text())["rows"] if r["mode"] == "forward+backward"]
    assert [r["focus_backend"] for r in rows] == ["dense", "sdpa"]
    assert [r["gate"]["checked"] for r in rows] == ["dq, dk, dv at T=128, backend dense",
                                                    "dq, dk, dv at T=128, backend sdpa"]
    assert {(128, "dense"), (128, "sdpa")} <= set(gated)


def test_rows_measured_before_a_crash_are_on_disk(tmp_path, monkeypatch):
    """The JSON is rewritten (atomically) as rows complete: an error in the decode rows leaves the prefill rows,
    marked incomplete."""
    from sieve_attn.bench import focus as bench_focus

    def crash(*args):
        raise RuntimeError("the machine went away")
    monkeypatch.setattr(bench_focus, "decode_rows", crash)
    out = tmp_path / "bench"
    with pytest.raises(RuntimeError, match="went away"):
        main(["bench", "focus", *TINY, "--out", str(out)])
    record = json.loads((out / "bench_focus.json").read_text())
    assert record["complete"] is False and [r["T"] for r in record["rows"]] == [256, 256, 512, 512]
    assert main(["bench", "focus", *TINY, "--decode-lengths", "", "--out", str(out)]) == 0
    assert json.loads((out / "bench_focus.json").read_text())["complete"] is True


@pytest.mark.parametrize("options, message", [
    (["--warmup", "-1"], "--warmup: expected an integer >= 0"),
    (["--budget", "0"], "--budget: expected a finite number of seconds > 0"),
    (["--max-call-seconds", "-1"], "--max-call-seconds: expected a finite number of seconds > 0"),
    (["--window", "-1"], "--window: expected an int >= 0, got -1"),
    (["--groups", "4,2048", "--top-k", "2"], "--spread: 'combinations' deals all C\\(K=2048, top-k=2\\)"),
    (["--cuda-graphs", "--skip-nan-checks"], "--cuda-graphs: expected with a CUDA --device"),
    (["--device", "foo"], "--device: expected cpu or a CUDA device"),
    (["--out", __file__], "--out: expected a folder this run can write"),
])
def test_options_that_cannot_run_are_refused_before_anything_is_timed(tmp_path, capsys, options, message):
    out = [] if "--out" in options else ["--out", str(tmp_path / "bench")]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "focus", *TINY, *options, *out])
    captured = capsys.readouterr()
    # argparse's own refusals are printed and exit with 2; ours carry their message
    assert re.search(message, captured.err if exit_info.value.code == 2 else str(exit_info.value.code))
    assert "| forward |" not in captured.out
