"""MIB's MCQA task from templates (iglens_mib_tasks): the items say what the module says, and MIB's harness
runs them as it runs IOI."""
import re

import numpy as np
import pytest

import iglens_mib as mib
import iglens_mib_tasks as igmt
from conftest import tiny_model
from test_mib import ATOL, tokenizer  # noqa: F401 (a fixture): the harness's end-point tolerance, SmolLM2's tokenizer


def choices(prompt: str) -> list[tuple[str, str]]:
    """(letter, colour) of each choice line, in order."""
    return re.findall(r"^([A-Z])\. (\w+)$", prompt, flags=re.M)


def test_mcqa_items(tokenizer):
    items = igmt.mcqa_items(tokenizer, 16, seed=3)
    again = igmt.mcqa_items(tokenizer, 16, seed=3)  # seeded
    assert [(i.clean, i.corrupted) for i in items] == [(i.clean, i.corrupted) for i in again]
    assert len({i.template for i in items}) > 1  # the answer's position varies
    for item in items:
        stated = re.search(r"are (\w+)\. What color", item.clean).group(1)
        clean, corrupted = choices(item.clean), choices(item.corrupted)
        assert [letter for letter, _ in clean] == list("ABCD")
        assert [c for _, c in clean] == [c for _, c in corrupted] and stated in [c for _, c in clean]
        assert sorted(letter for letter, _ in corrupted) == list("ABCD")  # the symbols permuted
        assert item.answer == " " + dict((c, l) for l, c in clean)[stated]
        assert item.foil == " " + dict((c, l) for l, c in corrupted)[stated] != item.answer
        assert item.clean.split("\n")[0] == item.corrupted.split("\n")[0] and item.clean.endswith("\nAnswer:")
        assert len(item.clean_ids) == len(item.corrupted_ids) and item.order == "MCQA"
        differ = (item.clean_ids != item.corrupted_ids).nonzero().flatten().tolist()
        assert 2 <= len(differ) <= 4  # only the letters that moved
        assert tokenizer.decode([item.answer_id]) == item.answer and tokenizer.decode([item.foil_id]) == item.foil


def test_task_items_and_bad_input(tokenizer):
    ioi = igmt.task_items("ioi", tokenizer, 4, seed=2)
    assert [i.clean for i in ioi] == [i.clean for i in mib.ioi_items(tokenizer, 4, seed=2)]
    assert [i.clean for i in igmt.task_items("mcqa", tokenizer, 3)] == [i.clean for i in igmt.mcqa_items(tokenizer, 3)]
    with pytest.raises(ValueError, match="task must be one of"):
        igmt.task_items("arithmetic", tokenizer, 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            igmt.mcqa_items(tokenizer, bad)

    class Split:  # a tokenizer that spells " A" in two tokens
        def __call__(self, text, add_special_tokens=False):
            return type("Encoding", (), {"input_ids": [ord(ch) for ch in text]})()
    with pytest.raises(ValueError, match="one token"):
        igmt.mcqa_items(Split(), 2)


def test_the_harness_runs_mcqa(tokenizer):
    """keep_solved's count and the Evaluation's end points on MCQA items, on a tiny model with SmolLM2's vocabulary."""
    model = tiny_model("llama", seed=5, vocab_size=tokenizer.vocab_size + len(tokenizer.get_added_vocab()))
    items = igmt.mcqa_items(tokenizer, 4, seed=0)
    kept, report = mib.keep_solved(model, items, quiet=True)
    assert report["total"] == 4 and report["solved"] == len(kept) == int((report["logit_diffs"] > 0).sum())
    ev = mib.Evaluation(model, items, batch_size=4)
    assert np.allclose(ev.m_empty, mib.logit_diffs(model, items, corrupted=True), atol=ATOL)
    assert ev.faithfulness(ev.graph.real) == pytest.approx(1, abs=1e-4)
