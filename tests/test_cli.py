"""The `sieve` command line: help texts, and retrofit -> eval ppl end to end on the real default model."""
import json

import pytest

from sieve_attn.cli import build_parser, main


@pytest.mark.parametrize("argv", [[], ["demo"], ["retrofit"], ["eval"], ["eval", "ppl"]])
def test_help_explains_every_command(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: sieve" in text and len(text.splitlines()) > 5


def test_eval_rejects_unknown_modes():
    with pytest.raises(SystemExit, match="--modes"):
        main(["eval", "ppl", "--modes", "dense,fast"])


def test_focus_modes_need_an_adapter():
    with pytest.raises(SystemExit, match="--adapter"):
        main(["eval", "ppl", "--modes", "hard"])


@pytest.mark.slow
def test_retrofit_then_eval_ppl(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--context", "64", "--threads", "1"]
    assert main(["retrofit", *common, "--steps", "2", "--window", "8", "--num-groups", "4", "--top-k", "1",
                 "--checkpoint-every", "1", "--out", str(out)]) == 0
    assert (out / "adapter" / "adapter.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    record_path = tmp_path / "ppl.json"
    assert main(["eval", "ppl", *common, "--eval-windows", "1", "--adapter", str(out / "adapter"), "--top-k", "2",
                 "--json", str(record_path)]) == 0
    record = json.loads(record_path.read_text())
    rows = {row["mode"]: row for row in record["rows"]}
    assert set(rows) == {"dense", "soft", "hard"}
    assert record["focus_config"]["top_k"] == 2 and record["windows"] == 1
    assert all(row["tokens"] == 63 and 1 < row["ppl"] < 1000 for row in rows.values())
    assert 0 < rows["hard"]["pairs_attended"] < 1
    assert "| hard |" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_is_reproducible(tmp_path):
    """Two demos in one process (the global random state moved on between them) train and score alike."""
    import torch

    runs = []
    for name in ("a", "b"):
        torch.rand(7)
        assert main(["demo", "--context", "64", "--threads", "2", "--steps", "1", "--eval-windows", "1",
                     "--num-groups", "4", "--out", str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name / "results.json").read_text()))
    assert runs[0]["loss_history"] == runs[1]["loss_history"] and runs[0]["rows"] == runs[1]["rows"]
