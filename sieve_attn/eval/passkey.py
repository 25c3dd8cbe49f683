"""Pass-key retrieval: whether a model finds a five-digit number hidden at a chosen depth of a long filler text,
the test of long-context recall that sparse-attention papers report beside perplexity (distant tokens are what a
sparse pattern may drop)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .._checks import check_int, check_real, fail

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


@torch.no_grad()
def passkey_retrieval(model, prompts: Sequence[PasskeyPrompt], *, desc: str = "passkey",
                      progress: bool = True) -> list[dict]:
    """Scores each prompt by one causal forward of its ids and answer (teacher forcing). Returns per prompt
    {"length", "depth", "key", "found", "answer_logprob"}: ``found`` is whether every answer token is the argmax of
    the logits before it, which is exactly when greedy decoding from the prompt writes the key; ``answer_logprob``
    the sum of the answer tokens' log-probabilities (natural log)."""
    device = next(model.parameters()).device
    rows = []
    for prompt in tqdm(prompts, desc=desc, disable=not progress, leave=False):
        ids = torch.tensor([prompt.ids + prompt.answer], device=device)
        logits = model(ids, use_cache=False).logits[0, len(prompt.ids) - 1:-1].float()
        answer = torch.tensor(prompt.answer, device=device)
        logprob = torch.log_softmax(logits, -1).gather(-1, answer[:, None]).sum()
        rows.append({"length": prompt.length, "depth": prompt.depth, "key": prompt.key,
                     "found": bool((logits.argmax(-1) == answer).all()), "answer_logprob": float(logprob)})
    return rows


def retrieval_rates(rows: Sequence[dict]) -> dict[tuple[int, float], float]:
    """{(length, depth): fraction of its prompts found}, in the rows' order."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for row in rows:
        cells.setdefault((row["length"], row["depth"]), []).append(row["found"])
    return {cell: sum(found) / len(found) for cell, found in cells.items()}
