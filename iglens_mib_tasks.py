"""MIB's second circuit task offline: multiple-choice colour copying (MCQA), from templates.

MIB's MCQA task (``copycolors_mcqa``, four answer choices) asks a question whose answer the prompt itself
states, then lists four colours under the letters A-D::

    Question: Boxes are brown. What color are boxes?
    A. green
    B. brown
    C. blue
    D. gray
    Answer:

The answer is the letter of the stated colour. Its counterfactual (``symbol_counterfactual``) keeps the
question and the colours in their order and changes only the symbols: here the four letters are
permuted so that the stated colour's letter changes, and the answer moves to the new letter. The
circuit has to find which letter stands next to the stated colour, not which colour is right.
MIB's own items come from its dataset on the Hugging Face hub, which this repository does not download:
these are drawn from the same template with a seeded ``random.Random``, and the permutation of the letters
is our reading of the symbol counterfactual (MIB's exact draw is not available offline).

Measured on the packaged models (``mcqa_items(tokenizer, n, seed=0)``, 2026-12-07; solved: the answer letter's
logit above the counterfactual letter's): SmolLM2-135M-Instruct 23 of 48 (mean logit difference 0.02) and
Gemma 3 270M 26 of 48 (0.09), chance: they do not do the task; Qwen2.5-Coder-1.5B-Instruct 24 of 24 (mean
4.19, median 4.15). Notebook 12 runs it with ``task="mcqa"``.
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np
import torch

from iglens_mib import IOIItem, encode_prompt, ioi_items

MCQA_NOUNS = ("boxes", "apples", "cars", "chairs", "shirts", "flowers", "houses", "balloons", "books", "pens",
              "cups", "hats", "shoes", "doors", "walls", "bikes", "boats", "kites", "lamps", "bags",
              "tables", "bottles", "buttons", "ribbons", "blankets", "candles", "pillows", "scarves",
              "umbrellas", "envelopes")
MCQA_COLORS = ("red", "blue", "green", "yellow", "white", "black", "brown", "gray", "pink", "purple", "orange")
LETTERS = "ABCD"
TASKS = ("ioi", "mcqa")


def mcqa_prompt(noun: str, color: str, choices: Sequence[str], letters: str = LETTERS) -> str:
    """The question, the choices under ``letters`` (one per choice, in order) and ``Answer:``."""
    lines = [f"Question: {noun.capitalize()} are {color}. What color are {noun}?"]
    lines += [f"{letter}. {choice}" for letter, choice in zip(letters, choices)]
    return "\n".join(lines + ["Answer:"])


def mcqa_items(tokenizer, n: int, *, seed: int = 0, bos: bool = True) -> list[IOIItem]:
    """``n`` MCQA items (module docstring) as :class:`iglens_mib.IOIItem`, so MIB's harness runs them as it
    runs IOI: ``answer`` / ``answer_id`` the letter of the stated colour (``" B"``: the token after
    ``"Answer:"``), ``foil`` / ``foil_id`` that colour's letter in the counterfactual, ``order`` ``"MCQA"``
    and ``template`` the answer's position (0-3). Items whose two prompts encode to different lengths
    are redrawn."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    letter_ids = [tokenizer(" " + letter, add_special_tokens=False).input_ids for letter in LETTERS]
    if any(len(ids) != 1 for ids in letter_ids):
        raise ValueError(f"the tokenizer must encode each of ' A' .. ' D' as one token, got {letter_ids}")
    rng, items, tries = random.Random(seed), [], 0
    while len(items) < n:
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"could not draw {n} MCQA items of equal clean/counterfactual length")
        noun = rng.choice(MCQA_NOUNS)
        choices = rng.sample(MCQA_COLORS, len(LETTERS))
        position = rng.randrange(len(LETTERS))
        color = choices[position]
        while True:  # the symbols permuted so that the stated colour's letter changes
            letters = "".join(rng.sample(LETTERS, len(LETTERS)))
            if letters[position] != LETTERS[position]:
                break
        clean, corrupted = mcqa_prompt(noun, color, choices), mcqa_prompt(noun, color, choices, letters)
        clean_ids, corrupted_ids = encode_prompt(tokenizer, clean, bos), encode_prompt(tokenizer, corrupted, bos)
        if len(clean_ids) != len(corrupted_ids):
            continue
        items.append(IOIItem(clean, corrupted, " " + LETTERS[position], " " + letters[position], "MCQA", position,
                             torch.tensor(clean_ids), torch.tensor(corrupted_ids), letter_ids[position][0],
                             letter_ids[LETTERS.index(letters[position])][0]))
    return items


def task_items(task: str, tokenizer, n: int, *, seed: int = 0) -> list[IOIItem]:
    """``n`` seeded items of one of :data:`TASKS` (``"ioi"``: :func:`iglens_mib.ioi_items`)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return (ioi_items if task == "ioi" else mcqa_items)(tokenizer, n, seed=seed)
