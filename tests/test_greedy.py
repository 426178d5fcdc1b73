"""greedy_answers does not depend on the batch: no padding (only prompts of one length share a batch)
and the tie rule (ties with the largest logit go to the lowest id) absorb the rounding of the shared
matrix products, so batch_size, the order of the prompts and the batch's other prompts change nothing."""
import random

import pytest
import torch

import iglens_core as ig
import iglens_data as igd
from conftest import tiny_model
from test_dataset import VOCAB, tokenizer  # noqa: F401 (fixture: the packaged tokenizer)

# three prompts of one length (37 tokens with the chat template: one batch) and two others
QUESTIONS = ["What is the capital of France?", "What is the capital of Egypt?", "Who wrote Hamlet?",
             "Who invented the telephone?", "What language is spoken in Brazil?"]


def _prompts(tokenizer, questions):
    return [ids[0, :n].tolist() for ids, n in (igd.encode(tokenizer, q, "x") for q in questions)]


def _check_batch_free(model, tokenizer, prompts, max_new_tokens, single=True):
    """The answers of batch_size=1 (each prompt alone) again with other batch sizes and shuffled."""
    alone = igd.greedy_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=1)
    if single:
        assert alone[0] == igd.greedy_answer(model, tokenizer, prompts[0], max_new_tokens)
    assert igd.greedy_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=16) == alone
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    shuffled = igd.greedy_answers(model, tokenizer, [prompts[i] for i in order], max_new_tokens=max_new_tokens,
                                  batch_size=2)
    assert shuffled == [alone[i] for i in order]
    return alone


def test_greedy_answers_tiny_model(tokenizer):
    model = tiny_model("llama", seed=5, vocab_size=VOCAB)
    # several prompts of one length (batched together) and some of other lengths
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 6, 6, 9, 6, 9, 4)]
    alone = _check_batch_free(model, tokenizer, prompts, 5)
    assert all(len(a) == 5 for a in alone)  # a random model over 49152 tokens does not stop


def test_greedy_answers_packaged_model(packaged):
    model, tokenizer = packaged
    prompts = _prompts(tokenizer, QUESTIONS)
    assert sorted(len(p) for p in prompts).count(37) == 3
    alone = _check_batch_free(model, tokenizer, prompts, 7, single=False)  # 7 tokens reach "Paris"
    assert "Paris" in tokenizer.decode(alone[0])


def test_tie_rule_picks_the_lowest_tied_id():
    rule = igd._tie_rule_processor()
    scores = torch.tensor([[0.0, 5.0, 5.0 - 1e-4, 3.0, float("-inf")],
                           [0.0, 5.0, 5.0 + 1e-4, 3.0, 1.0],
                           [0.0, 5.0, 4.9, 3.0, 1.0]])
    picked = rule(None, scores).argmax(-1).tolist()
    # row range 5: tolerance 1e-5 + 1e-4 * 5 = 5.1e-4, so 5 and 5 -/+ 1e-4 are tied; 4.9 is not
    assert picked == [1, 1, 1]
    assert ig.RANK_ATOL + ig.RANK_RTOL * 5.0 == pytest.approx(5.1e-4)
    assert rule(None, scores)[0].isfinite().sum() == 1
