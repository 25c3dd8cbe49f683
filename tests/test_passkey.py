"""Pass-key retrieval (sieve_attn.eval.passkey and `sieve eval passkey`): the prompts, the scoring against greedy
decoding without a cache, the command's refusals and its record."""
import json
import math

import pytest
import torch

import sieve_attn as sa
from sieve_attn.cli import main
from sieve_attn.eval.passkey import (FILLER, INTRO, NEEDLE, QUESTION, PasskeyPrompt, passkey_prompts,
                                     passkey_retrieval, retrieval_rates)
from sieve_attn.eval.generate import greedy_recompute
from tests.models import tiny_model


class _Chars:
    """Each character its own token (its code point), so a prompt's text can be read back from its ids."""

    def __call__(self, text, add_special_tokens=False):
        class Encoded:
            input_ids = [ord(c) for c in text]
        return Encoded()


def _text(ids) -> str:
    return "".join(map(chr, ids))


def test_prompts_are_their_length_with_the_key_where_their_depth_puts_it():
    prompts = passkey_prompts(_Chars(), [400, 700], [0, 0.5, 1], 2, seed=3)
    assert [(p.length, p.depth) for p in prompts] == [(n, d) for n in (400, 700) for d in (0.0, 0.5, 1.0)
                                                      for _ in range(2)]
    for prompt in prompts:
        needle = NEEDLE.format(key=prompt.key)
        text = _text(prompt.ids)
        assert len(prompt.ids) == prompt.length and 10000 <= prompt.key <= 99999
        assert text.startswith(INTRO) and text.endswith(QUESTION) and text.count(str(prompt.key)) == 2
        assert text[prompt.needle_at:prompt.needle_at + len(needle)] == needle
        assert _text(prompt.answer) == f" {prompt.key}"
        filler = prompt.length - len(INTRO) - len(needle) - len(QUESTION)
        assert prompt.needle_at - len(INTRO) == round(prompt.depth * filler)  # depth 0: after the intro; 1: last
        assert (text[len(INTRO):prompt.needle_at] + text[prompt.needle_at + len(needle):-len(QUESTION)]) == \
            (FILLER * 20)[:filler]  # the filler, cut by the needle, continues across it
    assert len({p.key for p in prompts}) == len(prompts)
    assert [p.key for p in passkey_prompts(_Chars(), [400, 700], [0, 0.5, 1], 2, seed=3)] == [p.key for p in prompts]
    assert [p.key for p in passkey_prompts(_Chars(), [400, 700], [0, 0.5, 1], 2, seed=4)] != [p.key for p in prompts]


@pytest.mark.parametrize("lengths, depths, trials, message", [
    ([100], [0.5], 1, r"lengths: expected at least 2\d\d tokens \(the intro, needle and question\), got 100"),
    ([400], [1.5], 1, r"depths: expected numbers in \[0, 1\], got 1.5"),
    ([400], [float("nan")], 1, r"depths: expected numbers in \[0, 1\], got nan"),
    ([400], [0.5], 0, r"trials: expected an int in \[1, inf\], got 0"),
    ([], [0.5], 1, "lengths: expected at least one value, got none"),
    ([400.5], [0.5], 1, r"lengths: expected an int in \[1, inf\], got 400.5"),
])
def test_prompts_refuse_bad_settings(lengths, depths, trials, message):
    with pytest.raises(ValueError, match=message):
        passkey_prompts(_Chars(), lengths, depths, trials)


class _Letters:
    """Decodes each token id to one of 19 characters, "1"-"9" or "a"-"j" (no zero, so every number of a reply reads
    back as the int it was)."""
    CHARS = "123456789abcdefghij"

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.CHARS[i % len(self.CHARS)] for i in ids)


@torch.no_grad()
def test_found_is_the_first_number_greedy_decoding_writes_and_immediate_its_start():
    model = tiny_model("llama")
    prompt_ids = torch.randint(0, 100, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    reply = greedy_recompute(model, torch.tensor([prompt_ids]), 10)[0, 30:].tolist()  # no cache
    text = _Letters().decode(reply)
    assert text == "a32b142g72"  # a letter first, then numbers: 32 is the first, 142 is not
    cases = [(32, reply[:3]), (142, reply[:3]), (32, [reply[0] + 1] + reply[1:3]), (32, reply[:2] + [reply[2] + 1])]
    prompts = [PasskeyPrompt(tuple(prompt_ids), tuple(answer), 40, 0.5, key, 3) for key, answer in cases]
    rows = passkey_retrieval(model, _Letters(), prompts, progress=False)  # through the KV cache
    assert [row["reply"] for row in rows] == [text] * 4
    assert [(row["found"], row["immediate"]) for row in rows] == [(True, True), (False, True), (True, False),
                                                                  (True, False)]
    logits = model(torch.tensor([prompt_ids + reply[:3]])).logits[0].double()
    expected = sum(float(torch.log_softmax(logits[29 + i], -1)[token]) for i, token in enumerate(reply[:3]))
    assert math.isclose(rows[0]["answer_logprob"], expected, rel_tol=1e-5)
    assert rows[2]["answer_logprob"] < rows[0]["answer_logprob"]
    assert retrieval_rates(rows) == {(40, 0.5): 3 / 4}
    with pytest.raises(ValueError, match=r"new_tokens: expected an int in \[3, inf\], got 2"):
        passkey_retrieval(model, _Letters(), prompts, new_tokens=2)


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "long"], "--lengths: expected a comma list of prompt lengths in tokens, got 'long'"),
    (["--lengths", "512,0"], "--lengths: expected lengths of at least 1 token, got '512,0'"),
    (["--depths", "0,2"], r"--depths: expected fractions in \[0, 1\], got '0,2'"),
    (["--trials", "0"], "--trials: expected at least 1, got 0"),
    (["--new-tokens", "0"], "--new-tokens: expected at least 1, got 0"),
    (["--plot", "/"], "--plot: expected a file path in a folder this run can write, got '/'"),
    (["--modes", "hard"], "--adapter: soft and hard need an adapter folder"),
])
def test_eval_passkey_refuses_bad_options_before_loading_the_model(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["eval", "passkey", "--model", str(tmp_path / "no model here"), *argv])


def test_eval_passkey_scores_each_mode_of_an_adapter_and_writes_its_record_and_heatmap(tmp_path, capsys):
    from tests.models import save_with_word_tokenizer

    words = " ".join([INTRO, FILLER, NEEDLE.format(key=12345), QUESTION])
    save_with_word_tokenizer(tiny_model("llama"), tmp_path / "model", words)
    sa.save_adapter(sa.compose(tiny_model("llama"), sa.FocusConfig(num_groups=4, window=8, top_k=1, sink_tokens=1)),
                    tmp_path / "adapter")
    record_path, plot_path = tmp_path / "passkey.json", tmp_path / "out" / "passkey.png"
    assert main(["eval", "passkey", "--model", str(tmp_path / "model"), "--adapter", str(tmp_path / "adapter"),
                 "--lengths", "80,120", "--depths", "0,1", "--trials", "2", "--threads", "1", "--sink-tokens", "3",
                 "--json", str(record_path), "--plot", str(plot_path)]) == 0
    out = capsys.readouterr().out
    assert "| mode | 80 tokens | 120 tokens |" in out and "| hard |" in out
    record = json.loads(record_path.read_text())
    rows = record["rows"]
    assert [row["mode"] for row in rows] == ["dense"] * 8 + ["soft"] * 8 + ["hard"] * 8
    assert [row["key"] for row in rows[:8]] == [row["key"] for row in rows[8:16]] == [row["key"] for row in rows[16:]]
    assert {(row["length"], row["depth"]) for row in rows} == {(80, 0.0), (80, 1.0), (120, 0.0), (120, 1.0)}
    assert record["focus_config"]["num_groups"] == 4 and record["focus_config"]["sink_tokens"] == 3
    assert record["lengths"] == [80, 120] and record["trials"] == 2
    assert plot_path.read_bytes().startswith(b"\x89PNG")
    # The dense rows are the plain model's own scores.
    from sieve_attn.models import load_model

    model, tokenizer = load_model(str(tmp_path / "model"))
    prompts = passkey_prompts(tokenizer, [80, 120], [0, 1], 2)
    plain = passkey_retrieval(model, tokenizer, prompts, progress=False)
    fields = ("found", "immediate", "reply")
    assert [[r[f] for f in fields] + [round(r["answer_logprob"], 4)] for r in plain] == \
        [[r[f] for f in fields] + [round(r["answer_logprob"], 4)] for r in rows[:8]]


def test_eval_passkey_refuses_prompts_longer_than_a_models_learned_positions(tmp_path):
    from tests.models import save_with_word_tokenizer

    save_with_word_tokenizer(tiny_model("gpt2"), tmp_path / "model", " ".join([INTRO, FILLER, NEEDLE, QUESTION]))
    with pytest.raises(SystemExit, match=r"--lengths \(with the reply\): expected at most 256 \(the model's learned "
                                         r"positions\), got 310"):
        main(["eval", "passkey", "--model", str(tmp_path / "model"), "--lengths", "80,300", "--depths", "0"])
