"""`sieve generate`'s generation: the cache it picks, the bytes it reports, the check against recomputation."""
import json

import pytest
import torch

import sieve_attn as sa
from sieve_attn.cli import main
from sieve_attn.eval.generate import generate
from sieve_attn.ops.sfa.cache import packed_bytes
from tests.models import VOCAB, save_with_word_tokenizer, threads, tiny_model


class DigitTokenizer:
    """Token ids from text of digits separated by spaces ("12 7 3" -> [12, 7, 3]), and back."""

    def __call__(self, text, return_tensors="pt"):
        return type("Encoding", (), {"input_ids": torch.tensor([[int(t) for t in text.split()]])})

    def decode(self, ids, skip_special_tokens=True):
        return " " + " ".join(str(int(t)) for t in ids)


@pytest.mark.parametrize("configs, kind", [([], "DynamicCache"), ([sa.SFAConfig(topk=4)], "SFACache"),
                                           ([sa.FocusConfig(num_groups=4, window=4, top_k=1)], "DynamicCache")])
def test_generation_reports_its_cache_and_equals_recomputation(configs, kind):
    model = tiny_model("llama")
    if configs:
        sa.compose(model, *configs)
    with threads(1):
        record = generate(model, DigitTokenizer(), " ".join(str(i % VOCAB) for i in range(3, 23)), 10, check=True)
    assert record["equals_recomputation"] is True and record["new_tokens"] == 10 and record["prompt_tokens"] == 20
    cache = record["cache"]
    held = 29 * 2 * 2  # tokens (all but the last generated one) x layers x KV heads
    assert cache["kind"] == kind and cache["dense_bytes"] == held * 2 * 16 * 4  # K and V, head dim 16, float32
    if kind == "SFACache":  # 4 codes of 4-bit indices and float32 values, and V
        assert cache["held_bytes"] == held * (packed_bytes(4, 16) + 4 * 4 + 16 * 4)
        assert cache["allocated_bytes"] >= cache["held_bytes"]
    else:
        assert cache["held_bytes"] == cache["allocated_bytes"] == cache["dense_bytes"]


def test_a_cache_that_changes_the_tokens_is_caught(monkeypatch):
    """--check fails a cache path that differs from recomputation (here: recomputation made to differ)."""
    import sieve_attn.eval.generate as generation

    model = tiny_model("llama")
    real = generation.greedy_recompute
    monkeypatch.setattr(generation, "greedy_recompute", lambda m, ids, steps: real(m, ids, steps) + 1)
    with threads(1):
        assert generate(model, DigitTokenizer(), "5 6 7", 3, check=True)["equals_recomputation"] is False


def test_generate_refuses_bad_counts(tmp_path):
    with pytest.raises(SystemExit, match="--max-new-tokens: expected at least 1, got 0"):
        main(["generate", "--model", str(tmp_path / "no model here"), "--max-new-tokens", "0"])
    with pytest.raises(ValueError, match="prompt: expected text of at least one token"):
        generate(tiny_model("llama"), DigitTokenizer(), "", 3)


@pytest.mark.slow
def test_generate_on_the_default_model_writes_its_record(tmp_path, capsys):
    assert main(["generate", "--threads", "1", "--max-new-tokens", "4", "--check", "--json",
                 str(tmp_path / "g.json")]) == 0
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["new_tokens"] == 4 and record["equals_recomputation"] is True
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):") and "equals recomputation without a cache: yes" in out


def test_a_focus_adapter_generates_in_hard_mode_whatever_mode_it_was_saved_in(tmp_path, capsys):
    """An adapter saved mid-training keeps mode "train", which cannot extend a cache: `sieve generate` failed with
    a traceback. It routes in hard mode unless --mode says otherwise, and says which mode ran."""
    import sysconfig
    from pathlib import Path

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    save_with_word_tokenizer(tiny_model("llama"), tmp_path / "model", text)
    composed = sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=2, top_k=1, sink_tokens=1))
    sa.save_adapter(sa.set_focus_mode(composed, "train"), tmp_path / "adapter")
    common = ["generate", "--model", str(tmp_path / "model"), "--adapter", str(tmp_path / "adapter"), "--threads",
              "1", "--prompt", "def wrap ( text )", "--max-new-tokens", "6", "--check"]
    for mode in ("hard", "soft"):
        assert main([*common, *(["--mode", mode] if mode != "hard" else []), "--json", str(tmp_path / "g.json")]) == 0
        assert f"Focus mode {mode}; DynamicCache" in capsys.readouterr().out
        assert json.loads((tmp_path / "g.json").read_text())["focus_config"]["mode"] == mode
    # eval's --top-k and --sink-tokens override the adapter's here too (the pass-key misses' remedy, for a prompt)
    assert main([*common, "--top-k", "2", "--sink-tokens", "3", "--json", str(tmp_path / "g.json")]) == 0
    config = json.loads((tmp_path / "g.json").read_text())["focus_config"]
    assert (config["mode"], config["top_k"], config["sink_tokens"]) == ("hard", 2, 3)
