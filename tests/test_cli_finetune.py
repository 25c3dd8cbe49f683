"""`sieve finetune`: SFA conversion and its dense baseline end to end on the real default model (tiny budget)."""
import json

import pytest
import torch

from sieve_attn._provenance import source_digest
from sieve_attn.cli import build_parser, main


def test_help_explains_finetune(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["finetune", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the description
    assert "--matching-weight" in text and "early stopping" in text and "--validation-windows" in text
    assert "--feature-map" in text and "principal axes" in text and "--calibration-windows" in text
    assert "--mixed-precision" in text and "autocast to bfloat16" in text
    assert "--selection" in text and "importance (default; largest |x| times the root mean square" in text
    assert "SFAConfig keeps magnitude as its default: its importance weights are all 1" in text
    assert "--teacher" in text and "KL(teacher || model)" in text
    assert "--sparsity-weight" in text and "the straight-through LM gradient never does" in text
    # Several processes: the split of each batch, and who evaluates and writes.
    assert "`accelerate launch`" in text and "--batch-size must be a multiple of the number of processes" in text
    assert "Every process computes the held-out perplexity" in text and "rank 0 alone prints it" in text


@pytest.mark.slow
@pytest.mark.parametrize("method, backend, feature_map, selection", [
    ("sfa", "auto", "pca", "magnitude"), ("sfa", "sdpa", "none", "importance"), ("dense", "auto", "pca", "magnitude")])
def test_finetune_writes_weights_adapter_and_result(tmp_path, method, backend, feature_map, selection):
    from safetensors.torch import load_file

    out = tmp_path / method
    sparsity = ["--sparsity-weight", "0.5"] if selection == "importance" else []
    assert main(["finetune", "--method", method, "--topk", "16", "--sfa-backend", backend, "--context", "32",
                 "--threads", "1", "--steps", "1", "--eval-windows", "1", "--feature-map", feature_map,
                 "--selection", selection, "--calibration-windows", "1", *sparsity, "--out", str(out)]) == 0
    record = json.loads((out / "result.json").read_text())
    assert record["settings"]["sparsity_weight"] == (0.5 if sparsity else 0.0)
    assert all((row[4] is not None) == bool(sparsity) for row in record["history"])
    assert record["method"] == method and record["ppl_before"] > 1 and record["ppl_after"] > 1
    assert (out / "model.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    assert not any(".sieve_sfa." in name for name in load_file(str(out / "model.safetensors")))
    assert (out / "adapter" / "adapter_config.json").is_file() == (method == "sfa")
    mapped = method == "sfa" and feature_map == "pca"
    calibrated = mapped or selection == "importance"
    assert record["feature_map"] == (feature_map if method == "sfa" else None)
    assert record["selection"] == (selection if method == "sfa" else None)
    assert (record["ppl_uncalibrated"] is not None) == calibrated
    assert record["calibration_windows"] == (1 if calibrated else None)
    if method == "sfa":
        config = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert config["sfa"]["backend"] == backend  # the adapter records the backend it was trained with
        assert config["sfa"]["feature_map"] == mapped
        adapter = load_file(str(out / "adapter" / "adapter.safetensors"))
        assert len([name for name in adapter if "feature_map" in name]) == (30 if mapped else 0)  # one per layer
        weights = [adapter[name] for name in adapter if "selection_weights" in name]
        assert len(weights) == (30 if selection == "importance" else 0)
        assert all(w.shape == (2, 3, 64) and not torch.equal(w, torch.ones_like(w)) for w in weights)  # calibrated
    # `sieve eval ppl` scores the fine-tuned model later: the same held-out windows give the same perplexity.
    adapter = ["--adapter", str(out / "adapter"), "--modes", "sfa"] if method == "sfa" else ["--modes", "dense"]
    assert main(["eval", "ppl", "--context", "32", "--threads", "1", "--eval-windows", "1", "--weights",
                 str(out / "model.safetensors"), *adapter, "--json", str(out / "eval.json")]) == 0
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["rows"][0]["ppl"] == pytest.approx(record["ppl_after"], rel=1e-6)
    assert (evaluated["sfa_config"] is None) == (method == "dense")
    if method == "sfa":  # the modes an SFA adapter allows by default; another backend computes the same scores
        assert main(["eval", "ppl", "--context", "32", "--threads", "1", "--eval-windows", "1", "--weights",
                     str(out / "model.safetensors"), "--adapter", str(out / "adapter"), "--sfa-backend",
                     "reference", "--json", str(out / "eval.json")]) == 0
        evaluated = json.loads((out / "eval.json").read_text())
        assert [row["mode"] for row in evaluated["rows"]] == ["dense", "sfa"]
        assert evaluated["sfa_config"]["backend"] == "reference"
        assert evaluated["rows"][1]["ppl"] == pytest.approx(record["ppl_after"], rel=1e-4)
        # `sieve generate` takes the same override (an adapter trained with triton, run on a CPU).
        assert main(["generate", "--threads", "1", "--weights", str(out / "model.safetensors"), "--adapter",
                     str(out / "adapter"), "--sfa-backend", "reference", "--max-new-tokens", "3", "--check",
                     "--json", str(out / "generate.json")]) == 0
        generated = json.loads((out / "generate.json").read_text())
        assert generated["sfa_config"]["backend"] == "reference" and generated["focus_config"] is None
        # The maps belong with the fine-tuned weights: scoring them on other weights is refused before it starts.
        from safetensors.torch import save_file
        from sieve_attn.train.checkpoint import tensors_digest
        weights = load_file(str(out / "model.safetensors"))
        assert config["weights_digest"] == tensors_digest(weights)
        common = ["eval", "ppl", "--context", "32", "--threads", "1", "--eval-windows", "1", "--adapter",
                  str(out / "adapter")]
        with pytest.raises(SystemExit, match="--weights: expected the model.safetensors the adapter was trained "
                                             f"with \\({config['weights_digest']}\\), got none"):
            main(common)
        name = next(iter(weights))
        weights[name] = weights[name] + 1
        save_file(weights, str(tmp_path / "other.safetensors"))
        with pytest.raises(SystemExit, match="--weights: expected the model.safetensors the adapter was trained with"):
            main([*common, "--weights", str(tmp_path / "other.safetensors")])
        with pytest.raises(SystemExit, match="--weights: expected a safetensors file, got .*checkpoint.pt'"):
            main([*common, "--weights", str(out / "checkpoint.pt")])  # the training checkpoint: torch's format


@pytest.mark.slow
def test_finetune_distills_from_the_dense_baseline(tmp_path):
    common = ["--context", "32", "--threads", "1", "--steps", "2", "--eval-windows", "1", "--calibration-windows", "1"]
    assert main(["finetune", "--method", "dense", *common, "--out", str(tmp_path / "dense")]) == 0
    teacher = tmp_path / "dense" / "model.safetensors"
    assert main(["finetune", "--method", "sfa", *common, "--teacher", str(teacher), "--distill-weight", "2",
                 "--out", str(tmp_path / "sfa")]) == 0
    record = json.loads((tmp_path / "sfa" / "result.json").read_text())
    assert record["teacher"] == str(teacher) and record["settings"]["distill_weight"] == 2.0
    assert record["selection"] == "importance"  # the default
    assert record["environment"]["source_digest"] == source_digest()  # names the code that trained it
    assert all(row[3] > 0 for row in record["history"])  # the KL term of every step
    with pytest.raises(SystemExit, match="--teacher: expected the"):
        main(["finetune", *common, "--teacher", str(tmp_path / "sfa" / "adapter" / "adapter.safetensors"),
              "--out", str(tmp_path / "bad")])
    not_weights = tmp_path / "notes.txt"
    not_weights.write_text("not a safetensors file")
    with pytest.raises(SystemExit, match="--teacher: expected a safetensors file, got .*notes.txt', which cannot"):
        main(["finetune", *common, "--teacher", str(not_weights), "--out", str(tmp_path / "bad")])
    # --init starts from the dense fine-tune: before training it scores what that fine-tune scored after.
    assert main(["finetune", "--method", "dense", *common, "--init", str(teacher),
                 "--out", str(tmp_path / "init")]) == 0
    started = json.loads((tmp_path / "init" / "result.json").read_text())
    dense = json.loads((tmp_path / "dense" / "result.json").read_text())
    assert started["init"] == str(teacher) and dense["init"] is None
    assert started["ppl_before"] == pytest.approx(dense["ppl_after"], rel=1e-6)
    assert dense["ppl_after"] != dense["ppl_before"]  # the two steps moved the weights
    # An SFA conversion loads --init before it composes and calibrates: its plain top-k already scores otherwise.
    assert main(["finetune", "--method", "sfa", *common, "--init", str(teacher),
                 "--out", str(tmp_path / "sfa_init")]) == 0
    converted = json.loads((tmp_path / "sfa_init" / "result.json").read_text())
    assert converted["ppl_uncalibrated"] != record["ppl_uncalibrated"]
    with pytest.raises(SystemExit, match="--init: expected the"):
        main(["finetune", *common, "--init", str(tmp_path / "sfa" / "adapter" / "adapter.safetensors"),
              "--out", str(tmp_path / "bad")])


@pytest.mark.parametrize("options, message", [
    (["--distill-weight", "2"], "--distill-weight: expected only with --teacher, got 2 without"),
    (["--teacher", "missing.safetensors"], "--teacher: expected an existing model.safetensors file, got "
                                           "'missing.safetensors'"),
    (["--teacher", __file__, "--distill-weight", "0"], "--distill-weight: expected a finite number > 0 with "
                                                       "--teacher, got 0"),
    (["--teacher", __file__, "--distill-weight", "nan"], "--distill-weight: expected a finite number > 0"),
    (["--init", "missing.safetensors"], "--init: expected an existing model.safetensors file, got "
                                        "'missing.safetensors'"),
])
def test_finetune_refuses_weight_options_that_cannot_run(tmp_path, options, message):
    with pytest.raises(SystemExit, match=message):
        main(["finetune", "--context", "32", "--threads", "1", "--steps", "1", *options, "--out", str(tmp_path)])


@pytest.mark.parametrize("options, message", [
    (["--matching-weight", "-1"], "--matching-weight: expected a finite number >= 0, got -1.0"),
    (["--topk-warmup", "-5"], r"--topk-warmup: expected an int in \[0, inf\], got -5"),
    (["--steps", "0"], r"--steps: expected an int in \[1, inf\], got 0"),
    (["--lr", "inf"], "--lr: expected a finite positive number, got inf"),
    (["--topk", "0"], r"--topk: expected an int in \[1, inf\], got 0"),
])
def test_finetune_refuses_bad_settings_by_option_before_loading_the_model(tmp_path, options, message):
    with pytest.raises(SystemExit, match=message):
        main(["finetune", "--model", str(tmp_path / "no model here"), *options, "--out", str(tmp_path)])


def test_a_topk_warmup_as_long_as_the_run_is_warned_of(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--model"):  # stops at the model, after the warning
        main(["finetune", "--model", str(tmp_path / "no model here"), "--steps", "3", "--topk-warmup", "3"])
    assert ("warning: --topk-warmup 3 is not shorter than --steps 3: no step trains at --topk 16, at which the "
            "model is then scored and saved") in capsys.readouterr().err


def test_a_dense_finetune_warns_of_the_sfa_options_it_ignores(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--steps"):  # stops before the model loads, after the warnings
        main(["finetune", "--method", "dense", "--model", str(tmp_path / "no model here"), "--topk", "8",
              "--feature-map", "none", "--steps", "0"])
    err = capsys.readouterr().err
    assert "warning: --topk 8 is ignored with --method dense" in err
    assert "warning: --feature-map 'none' is ignored with --method dense" in err and "--selection" not in err


@pytest.mark.slow
def test_finetune_refuses_a_topk_above_the_head_dim_by_option(tmp_path):
    with pytest.raises(SystemExit, match="--topk: expected at most the model's head dim 64, got 65"):
        main(["finetune", "--context", "32", "--threads", "1", "--topk", "65", "--out", str(tmp_path)])


@pytest.mark.slow
def test_finetune_names_training_text_too_short_for_a_window(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("hello world\n")
    with pytest.raises(SystemExit, match="--train-text: text: expected at least 32 tokens, got"):
        main(["finetune", "--method", "dense", "--context", "32", "--threads", "1", "--steps", "1",
              "--eval-windows", "1", "--train-text", str(text), "--out", str(tmp_path / "out")])


def test_finetune_refuses_no_calibration_windows(tmp_path):
    with pytest.raises(SystemExit, match="--calibration-windows: expected at least 1, got 0"):
        main(["finetune", "--context", "32", "--threads", "1", "--steps", "1", "--calibration-windows", "0",
              "--out", str(tmp_path)])


@pytest.mark.slow
def test_finetune_with_early_stopping_records_its_validations(tmp_path):
    assert main(["finetune", "--method", "dense", "--context", "32", "--threads", "1", "--steps", "2",
                 "--validate-every", "1", "--validation-windows", "2", "--eval-windows", "1", "--mixed-precision",
                 "bf16", "--out", str(tmp_path)]) == 0
    from safetensors.torch import load_file

    record = json.loads((tmp_path / "result.json").read_text())
    losses = [loss for _, loss in record["validations"]]
    assert [step for step, _ in record["validations"]] == [1, 2] and record["validation_windows"] == 2
    assert record["settings"]["mixed_precision"] == "bf16"
    assert record["train_text"] == ["stdlib"] and record["training_windows"] == 2
    assert record["best_step"] == 1 + losses.index(min(losses))
    best = load_file(str(tmp_path / f"best-{record['best_step']}.safetensors"))
    final = load_file(str(tmp_path / "model.safetensors"))
    assert best.keys() == final.keys() and all((best[name] == final[name]).all() for name in best)


def test_evaluate_modes_scores_each_kind_of_model_in_its_own_modes():
    import sieve_attn as sa
    from sieve_attn.eval.report import evaluate_modes
    from tests.models import random_ids, tiny_model

    windows = random_ids(1, 24)
    sfa = sa.compose(tiny_model("llama"), sa.SFAConfig(topk=4))
    assert [row["mode"] for row in evaluate_modes(sfa, windows, ["sfa"], progress=False)] == ["sfa"]
    with pytest.raises(ValueError, match="modes: expected one of sfa for a model composed with SFA alone, got dense"):
        evaluate_modes(sfa, windows, ["dense"], progress=False)
    with pytest.raises(ValueError, match="modes: expected one of dense for a plain model, got sfa"):
        evaluate_modes(tiny_model("llama"), windows, ["sfa"], progress=False)
    focus = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=2, window=4))
    with pytest.raises(ValueError, match="modes: expected one of dense, soft, hard for a model composed with Focus"):
        evaluate_modes(focus, windows, ["sfa"], progress=False)
    # Focus and SFA: "sfa" is SFA over every causal pair (Focus attending all of them), what SFA alone scores
    torch.manual_seed(0)
    both = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=4, top_k=1, mode="hard"),
                      sa.SFAConfig(topk=4))
    rows = evaluate_modes(both, windows, ["sfa", "hard"], progress=False)
    assert [row["mode"] for row in rows] == ["sfa", "hard"] and both.sieve_config.mode == "hard"
    sfa_alone = evaluate_modes(sfa, windows, ["sfa"], progress=False)[0]["ppl"]
    assert rows[0]["ppl"] == pytest.approx(sfa_alone, rel=1e-6) and rows[1]["ppl"] != rows[0]["ppl"]
    with pytest.raises(ValueError, match="modes: expected one of sfa, soft, hard for a model composed with Focus "
                                         "and SFA, got dense"):
        evaluate_modes(both, windows, ["dense"], progress=False)


@pytest.mark.slow
def test_focus_retrofitted_onto_an_sfa_model(tmp_path):
    """`sieve retrofit --sfa-adapter` trains routers on the converted model with its weights and SFA parts frozen;
    the Focus+SFA adapter it writes scores sfa (SFA alone: what the SFA adapter scores), soft and hard."""
    from safetensors.torch import load_file

    common = ["--context", "32", "--threads", "1"]
    sfa, both = tmp_path / "sfa", tmp_path / "both"
    assert main(["finetune", "--method", "sfa", "--topk", "16", *common, "--steps", "1", "--eval-windows", "1",
                 "--calibration-windows", "1", "--out", str(sfa)]) == 0
    weights = ["--weights", str(sfa / "model.safetensors")]
    with pytest.raises(SystemExit, match="--weights: expected the model.safetensors the adapter was trained with"):
        main(["retrofit", *common, "--window", "8", "--sfa-adapter", str(sfa / "adapter"), "--out", str(both)])
    assert main(["retrofit", *common, "--steps", "2", "--window", "8", "--num-groups", "4", "--top-k", "1",
                 "--sfa-adapter", str(sfa / "adapter"), *weights, "--out", str(both)]) == 0
    config = json.loads((both / "adapter" / "adapter_config.json").read_text())
    assert config["method"] == "focus+sfa"
    assert config["weights_digest"] == json.loads((sfa / "adapter" / "adapter_config.json").read_text())[
        "weights_digest"]
    sfa_tensors, both_tensors = (load_file(str(d / "adapter" / "adapter.safetensors")) for d in (sfa, both))
    assert sfa_tensors and all(torch.equal(both_tensors[name], t) for name, t in sfa_tensors.items())  # frozen
    assert any(".sieve_focus." in name for name in both_tensors)
    with pytest.raises(SystemExit, match="--sfa-adapter: expected an adapter of `sieve finetune --method sfa`, "
                                         "got one of method 'focus\\+sfa'"):
        main(["retrofit", *common, "--window", "8", "--sfa-adapter", str(both / "adapter"), *weights, "--out",
              str(tmp_path / "x")])
    records = {}
    for name in ("sfa", "both"):
        path = tmp_path / f"{name}.json"
        assert main(["eval", "ppl", *common, "--eval-windows", "1", "--adapter", str(tmp_path / name / "adapter"),
                     *weights, "--json", str(path)]) == 0
        records[name] = {row["mode"]: row for row in json.loads(path.read_text())["rows"]}
    assert list(records["both"]) == ["dense", "sfa", "soft", "hard"]
    assert records["both"]["sfa"]["ppl"] == pytest.approx(records["sfa"]["sfa"]["ppl"], rel=1e-6)
    assert records["both"]["dense"]["ppl"] == pytest.approx(records["sfa"]["dense"]["ppl"], rel=1e-6)
    assert 0 < records["both"]["hard"]["pairs_attended"] < 1
    # Focus's options reach the Focus of a Focus+SFA adapter: more groups per token attend more pairs.
    path = tmp_path / "both_top2.json"
    assert main(["eval", "ppl", *common, "--eval-windows", "1", "--adapter", str(both / "adapter"), *weights,
                 "--modes", "hard", "--top-k", "2", "--sink-tokens", "3", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert (record["focus_config"]["top_k"], record["focus_config"]["sink_tokens"]) == (2, 3)
    assert record["rows"][0]["pairs_attended"] > records["both"]["hard"]["pairs_attended"]
