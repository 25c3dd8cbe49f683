"""Pass-key retrieval: whether a model finds a five-digit number hidden at a chosen depth of a long filler text,
the test of long-context recall that sparse-attention papers report beside perplexity (distant tokens are what a
sparse pattern may drop)."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .._checks import check_int, check_real, fail
from .generate import greedy_continuation

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    """One prompt: ``ids`` (``length`` token ids: the intro, filler, the needle stating ``key``, more filler and the
    question, which ends where the key should follow) and ``answer`` (the ids of " <key>"). The needle starts at
    token ``needle_at``, after ``round(depth * F)`` of the F filler tokens: depth 0 puts it right after the intro,
    1 right before the question."""
    ids: tuple[int, ...]
    answer: tuple[int, ...]
    length: int
    depth: float
    key: int
    needle_at: int


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def passkey_prompts(tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int, *,
                    seed: int = 0) -> list[PasskeyPrompt]:
    """``trials`` prompts for each (length, depth), in that order, each with its own key drawn from
    ``random.Random(seed)`` in [10000, 99999]. The parts are tokenized apart and joined as ids, so every prompt is
    exactly its length; the filler repeats :data:`FILLER` and is cut where the length ends. Raises ValueError for a
    length shorter than the intro, needle and question together, a depth outside [0, 1] or trials < 1."""
    trials = check_int("trials", trials, 1)
    if not lengths or not depths:
        fail("lengths" if not lengths else "depths", "at least one value", "none")
    depths = [check_real("depths", depth, lambda x: 0 <= x <= 1, "numbers in [0, 1]") for depth in depths]
    intro, question, filler = _ids(tokenizer, INTRO), _ids(tokenizer, QUESTION), _ids(tokenizer, FILLER)
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        length = check_int("lengths", length, 1)
        for depth in depths:
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                needle = _ids(tokenizer, NEEDLE.format(key=key))
                fill = length - len(intro) - len(needle) - len(question)
                if fill < 0:
                    fail("lengths", f"at least {length - fill} tokens (the intro, needle and question)", length)
                text = (filler * (fill // len(filler) + 1))[:fill]
                cut = round(depth * fill)
                ids = intro + text[:cut] + needle + text[cut:] + question
                prompts.append(PasskeyPrompt(tuple(ids), tuple(_ids(tokenizer, f" {key}")), length, depth, key,
                                             len(intro) + cut))
    return prompts


def check_new_tokens(new_tokens, prompts: Sequence[PasskeyPrompt]) -> int:
    """``new_tokens`` as an int, where a reply of that many tokens can hold every prompt's answer; else
    ValueError naming ``new_tokens``."""
    longest = max((len(prompt.answer) for prompt in prompts), default=1)
    return check_int("new_tokens", new_tokens, longest)


# The first number of the reply, as landmark attention's pass-key test reads it (and the sparse-attention papers that
# reuse that test): a reply "the 12345." finds 12345.
_NUMBER = re.compile(r"\d+")


@torch.no_grad()
def passkey_retrieval(model, tokenizer, prompts: Sequence[PasskeyPrompt], *, new_tokens: int = 10,
                      desc: str = "passkey", progress: bool = True) -> list[dict]:
    """Scores each prompt by greedy decoding of ``new_tokens`` tokens through the model's KV cache
    (:func:`~sieve_attn.eval.generate.greedy_continuation`: transformers' ``generate``) and by one causal forward
    of its ids and answer (teacher forcing). Returns per prompt {"length", "depth", "key", "found", "immediate",
    "reply", "answer_logprob"}: ``reply`` the decoded continuation (shorter where the model ends its text);
    ``found`` whether the first number in the reply is the key; ``immediate`` whether the reply begins with the
    answer's tokens (the key written at once, with nothing before it: the stricter criterion); ``answer_logprob``
    the sum of the answer tokens' log-probabilities (natural log), each given the prompt and the answer tokens
    before it. Raises ValueError where ``new_tokens`` is fewer than an answer's tokens."""
    new_tokens = check_new_tokens(new_tokens, prompts)
    device = next(model.parameters()).device
    rows = []
    for prompt in tqdm(prompts, desc=desc, disable=not progress, leave=False):
        ids = torch.tensor([prompt.ids], device=device)
        reply = greedy_continuation(model, ids, new_tokens)[0, len(prompt.ids):].tolist()
        text = tokenizer.decode(reply, skip_special_tokens=True)
        number = _NUMBER.search(text)
        answer = torch.tensor(prompt.answer, device=device)
        logits = model(torch.cat([ids[0], answer])[None], use_cache=False).logits[0, len(prompt.ids) - 1:-1]
        logprob = torch.log_softmax(logits.float(), -1).gather(-1, answer[:, None]).sum()
        rows.append({"length": prompt.length, "depth": prompt.depth, "key": prompt.key,
                     "found": number is not None and number.group() == str(prompt.key),
                     "immediate": tuple(reply[:len(prompt.answer)]) == prompt.answer, "reply": text,
                     "answer_logprob": float(logprob)})
    return rows


def retrieval_rates(rows: Sequence[dict]) -> dict[tuple[int, float], float]:
    """{(length, depth): fraction of its prompts found}, in the rows' order."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for row in rows:
        cells.setdefault((row["length"], row["depth"]), []).append(row["found"])
    return {cell: sum(found) / len(found) for cell, found in cells.items()}
