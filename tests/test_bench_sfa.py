"""`sieve bench sfa` on the CPU: end to end on tiny sizes, the correctness gate, the work counts and the CLI help."""
import json
from types import SimpleNamespace

import pytest
import torch

from sieve_attn.bench.common import BACKWARD, DECODE, FORWARD
from sieve_attn.bench import sfa as bench_sfa
from sieve_attn.bench.sfa import cache_bytes, check_rows, decode_work, prefill_work
from sieve_attn.cli import main
from sieve_attn.config import sfa_decode_backend
from sieve_attn.ops.sfa.attention import sfa_attention
from sieve_attn.ops.triton_common import triton

TINY = ["--lengths", "128,256", "--head-dims", "32", "--heads", "2", "--topk", "4,8", "--decode-lengths", "256",
        "--decode-heads", "4/2", "--warmup", "0", "--reps", "1", "--gate-rows", "16", "--backend", "reference",
        "--device", "cpu"]


def test_main_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "sfa", *TINY, "--backward", "--backward-gate-length", "128", "--out", str(out)]) == 0
    record = json.loads((out / "bench_sfa.json").read_text())
    assert (out / "sfa_speedup_vs_length.png").stat().st_size > 0
    assert record["settings"]["lengths"] == [128, 256] and record["settings"]["top_ks"] == [4, 8]
    assert {"device", "torch", "triton", "cuda", "cudnn", "commit", "source_digest"} <= set(record["environment"])
    rows = record["rows"]
    assert [r["mode"] for r in rows].count(FORWARD) == 4 and [r["mode"] for r in rows].count(BACKWARD) == 4
    assert [r["mode"] for r in rows].count(DECODE) == 2
    assert all(r["correct"] and r["sfa"]["ms"] > 0 and r["sfa_backend"] == "reference" for r in rows)
    # cuDNN and the CUDA-core kernel are not timed on the CPU: recorded as unavailable, with the reason.
    forward = rows[0]
    cudnn, cuda_core = forward["baselines"]["cudnn"], forward["baselines"]["cuda-core"]
    assert cudnn["ms"] is None and "No viable backend" in cudnn["reason"] and forward["speedup"]["cudnn"] is None
    assert cuda_core["ms"] is None and cuda_core["reason"].startswith("unavailable")
    assert forward["speedup"]["flash"] == pytest.approx(forward["baselines"]["flash"]["ms"] / forward["sfa"]["ms"])
    backward = next(r for r in rows if r["mode"] == BACKWARD)
    assert backward["baselines"]["cuda-core"]["reason"].startswith("not applicable")
    decode = rows[-1]
    assert (decode["T"], decode["heads"], decode["kv_heads"], decode["topk"]) == (256, 4, 2, 8)
    assert decode["baselines"]["sdpa"]["backend"] in ("flash", "efficient", "math")
    assert decode["work"]["sfa_bytes_per_token"] == 5 + 8 * 2 + 32 * 2  # 8 packed 5-bit indices, 8 values, V
    assert [(c["head_dim"], c["topk"]) for c in record["kv_cache"]] == [(32, 4), (32, 8)]
    table = capsys.readouterr().out
    assert "| forward | 256 | 32 | 8 |" in table and "FAIL" not in table
    # cuDNN unavailable, the dense columns show the FlashAttention SDPA it timed, named.
    flash_cells = f"| {forward['baselines']['flash']['ms']:.3f} (flash) | {forward['speedup']['flash']:.2f}x |"
    assert flash_cells in table


def test_gate_fails_a_wrong_sfa_function_and_reports_no_time(tmp_path, capsys, monkeypatch):
    def wrong(q, k, v, *, topk, **kwargs):  # one coordinate too many: close to SFA, but not SFA
        return sfa_attention(q, k, v, topk=topk + 1, **kwargs)

    monkeypatch.setattr(bench_sfa, "sfa_attention", wrong)
    args = ["--lengths", "128", "--head-dims", "32", "--heads", "2", "--topk", "4", "--baselines", "flash",
            "--backward", "--backward-gate-length", "128", "--decode-lengths", "", "--warmup", "0", "--reps", "1",
            "--gate-rows", "8", "--backend", "reference", "--device", "cpu", "--out", str(tmp_path)]
    assert main(["bench", "sfa", *args]) == 1
    rows = json.loads((tmp_path / "bench_sfa.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == [FORWARD, BACKWARD]
    for row in rows:
        assert row["correct"] is False and row["gate"]["worst_ratio"] > 1
        assert row["sfa"]["ms"] is None and row["speedup"]["flash"] is None
        assert row["baselines"]["flash"]["ms"] is not None  # the dense baseline is still measured
    out = capsys.readouterr().out
    assert out.count("| FAIL |") == 2 and "2 configuration(s) FAILED" in out


def test_an_sfa_call_that_raises_fails_the_run_with_its_reason(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(bench_sfa, "sfa_attention", broken)
    args = ["--lengths", "128", "--head-dims", "32", "--heads", "2", "--topk", "4", "--decode-lengths", "",
            "--warmup", "0", "--reps", "1", "--gate-rows", "8", "--backend", "reference", "--device", "cpu",
            "--out", str(tmp_path)]
    assert main(["bench", "sfa", *args]) == 1
    row, = json.loads((tmp_path / "bench_sfa.json").read_text())["rows"]
    assert row["correct"] is None and row["sfa"]["ms"] is None
    assert "FAILED forward T=128 D=32: failed: RuntimeError: kernel launch failed" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, message", [("--heads", "0", "--heads: expected a positive integer"),
                                                    ("--reps", "0", "--reps: expected a positive integer")])
def test_bench_refuses_non_positive_counts(option, value, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sfa", option, value])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_refuses_a_device_it_does_not_have(tmp_path):
    with pytest.raises(SystemExit, match="--device: expected cpu or a CUDA device torch sees \\(0 here\\), got 'cuda'"):
        main(["bench", "sfa", "--device", "cuda", "--out", str(tmp_path)])


def test_gate_passes_sfa_and_fails_dense_attention_and_nan():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 32, dtype=torch.bfloat16) for _ in range(3))
    rows = torch.tensor([0, 5, 99, 199])
    good = sfa_attention(q, k, v, topk=8, backend="reference")
    assert check_rows(good, q, k, v, 8, rows).passed
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not check_rows(dense, q, k, v, 8, rows).passed
    poisoned = good.clone()
    poisoned[0, 1, 99] = float("nan")
    result = check_rows(poisoned, q, k, v, 8, rows)
    assert not result.passed and result.worst_ratio is None


def test_work_counts_of_the_paper_configurations():
    pairs = 8 * 65536 * 65537 // 2
    forward = prefill_work(FORWARD, 8, 65536, 128, 8)
    assert forward["pairs"] == pairs
    assert (forward["sfa_score_fma_per_pair"], forward["dense_score_fma_per_pair"]) == (8, 128)
    assert forward["sfa_flops"] == 2 * pairs * (8 + 128) and forward["dense_flops"] == 2 * pairs * 256
    assert forward["dense_over_sfa"] == pytest.approx(256 / 136)
    backward = prefill_work(BACKWARD, 1, 4, 64, 8)
    assert backward["sfa_flops"] == 2 * 10 * (5 * 8 + 4 * 64) and backward["dense_flops"] == 2 * 10 * 9 * 64
    decode = decode_work(8, 131072, 128, 16)
    # 16 packed 7-bit indices (14 bytes), 16 bf16 values, the bf16 V row
    assert (decode["sfa_bytes_per_token"], decode["dense_bytes_per_token"]) == (14 + 32 + 256, 512)
    assert decode["sfa_bytes"] == 302 * 8 * 131072
    cache, = cache_bytes((128,), (16, 256 + 1))  # a k above D has no cache
    assert (cache["sfa_bytes_per_token"], cache["dense_bytes_per_token"]) == (302, 512)
    assert cache["sfa_over_dense"] == 302 / 512 <= 0.59


def test_bench_sfa_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "sfa", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--lengths", "--heads", "--head-dims", "--topk", "--backend", "--baselines", "cuda-core",
                   "--backward", "--max-backward-length", "--decode-lengths", "--decode-heads", "--gate-rows",
                   "--device", "--out"):
        assert option in text


@pytest.mark.parametrize("requested, mode, want", [("auto", FORWARD, "sdpa"), ("auto", BACKWARD, "sdpa"),
                                                    ("auto", DECODE, "triton"), ("triton", FORWARD, "triton"),
                                                    ("sdpa", DECODE, "triton"), ("reference", FORWARD, "reference")])
def test_rows_name_the_backend_auto_takes_on_cuda(requested, mode, want):
    """On CUDA (a stand-in q: the choice reads shape, device and dtype only) auto prefills with sdpa, measured the
    faster on the H200, and decodes with the Triton kernel; each row records which, and why."""
    if want == "triton" and triton is None:
        pytest.skip("triton is not installed")
    q = SimpleNamespace(shape=(1, 8, 64, 128), device=torch.device("cuda"), dtype=torch.bfloat16)
    bench = SimpleNamespace(config=SimpleNamespace(backend=requested), decode_backend=sfa_decode_backend(requested))
    backend, reason = bench_sfa.Bench.backend_used(bench, q, mode)
    assert backend == want and reason
    if requested == "auto" and mode != DECODE:
        assert reason.startswith("auto on CUDA")


def test_topk_above_head_dim_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--topk"):
        main(["bench", "sfa", "--head-dims", "16", "--topk", "32", "--out", str(tmp_path)])


def test_skip_nan_checks_times_the_calls_without_the_nan_check(tmp_path, monkeypatch):
    """--skip-nan-checks: every SFA call runs inside sieve_attn.skip_nan_checks() (no NaN check is built), the
    setting is recorded, and the rows are still gated."""
    import sieve_attn._checks as checks

    built = []
    original = checks.nan_checks
    monkeypatch.setattr(checks, "nan_checks", lambda **tensors: built.append(original(**tensors)) or built[-1])
    args = ["--lengths", "128", "--head-dims", "32", "--heads", "2", "--topk", "4", "--baselines", "flash",
            "--decode-lengths", "256", "--decode-heads", "4/2", "--warmup", "0", "--reps", "1", "--gate-rows", "8",
            "--backend", "reference", "--device", "cpu"]
    assert main(["bench", "sfa", *args, "--skip-nan-checks", "--out", str(tmp_path / "skip")]) == 0
    assert built and not any(built)  # called by the ops, but empty
    record = json.loads((tmp_path / "skip" / "bench_sfa.json").read_text())
    assert record["settings"]["skip_nan_checks"] is True and all(r["correct"] for r in record["rows"])
    built.clear()
    assert main(["bench", "sfa", *args, "--out", str(tmp_path / "checked")]) == 0
    assert any(built)


def test_cuda_graphs_need_skip_nan_checks(tmp_path):
    with pytest.raises(SystemExit, match="^--cuda-graphs: expected with --skip-nan-checks"):
        main(["bench", "sfa", "--cuda-graphs", "--device", "cpu", "--out", str(tmp_path)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_graphed_decode_step_replays_the_same_step():
    """sfa_decode captured in a CUDA graph (inside skip_nan_checks) and replayed gives the plain call's output."""
    from sieve_attn import SFAKeyCache, sfa_decode, skip_nan_checks
    from sieve_attn.bench.timing import graphed

    torch.manual_seed(0)
    k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache = SFAKeyCache(1, 2, 64, topk=8, dtype=torch.bfloat16, device="cuda", capacity=300)
    cache.append(k, v)
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    outputs = []
    with skip_nan_checks():
        want, _ = sfa_decode(q, cache)
        replay = graphed(lambda: outputs.append(sfa_decode(q, cache)[0]))
        replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outputs[-1], want, rtol=0, atol=0)
