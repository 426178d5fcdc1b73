"""What the experiments run on: fact tables, per-relation draws, subject corruptions, tiny models.

Imports :mod:`iglens_core` and :mod:`iglens_data` (prompt tokens) and holds:

1. fact tables (``load_facts``: relation, subject, prompt, object; ``data/facts.csv``), the answer's
   object tokens and seeded per-relation draws (notebooks 04-10)
2. subject swaps and corrupted prompts of the same length (``corrupt_subject``, notebooks 05, 09), the
   answered facts and their clean and corrupted runs as the trace reads them (``answered_facts``,
   ``trace_setup``, notebooks 09, 13)
3. token spans of a word in a tokenised prompt (``word_spans``, notebooks 08, 09)
4. tiny randomly initialised models built from configs, with randomised norm weights
   (``tiny_model``, notebook 01 and the tests)
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from iglens_core import quiet_transformers


FACT_COLUMNS = ("relation", "subject", "prompt", "object")


def load_facts(source, *, statement: bool = False):
    """A fact table (one fact per row: ``relation, subject, prompt, object``, and ``answer``).

    A table without an ``id`` column gets one: ``<relation>_<k>``, k = 1, 2, ... within the relation
    in file order (the notebooks name items by it).

    Args:
        source: a CSV path, or a DataFrame.
        statement: for a base model: each prompt becomes its ``answer`` cut before the last
            occurrence of its ``object`` ("The capital of France is" for "... is Paris."), which
            the model must complete, and the answer the rest (" Paris.", with its leading space).

    Raises:
        ValueError: a missing column, or (``statement``) an answer that does not contain its object.
    """
    import pandas as pd
    facts = source.copy() if isinstance(source, pd.DataFrame) else pd.read_csv(source)
    missing = sorted(set(FACT_COLUMNS + (("answer",) if statement else ())) - set(facts.columns))
    if missing:
        raise ValueError(f"{'the fact table' if isinstance(source, pd.DataFrame) else source} lacks the columns "
                         f"{missing} (found {list(facts.columns)})")
    if statement:
        cut = [str(a).rfind(str(o)) for a, o in zip(facts.answer, facts.object)]
        bad = [i for i, at in enumerate(cut) if at < 0]
        if bad:
            raise ValueError(f"statement=True cuts each answer before its object, but {len(bad)} answers do not contain "
                             f"it (rows {bad[:5]}, e.g. {facts.answer.iloc[bad[0]]!r} / {facts.object.iloc[bad[0]]!r})")
        prompts = [str(a)[:at].rstrip() for a, at in zip(facts.answer, cut)]
        facts = facts.assign(prompt=prompts, answer=[str(a)[len(p):] for a, p in zip(facts.answer, prompts)])
    if "id" not in facts.columns:
        facts.insert(0, "id", [f"{r}_{k + 1:03d}" for r, k in zip(facts.relation, facts.groupby("relation").cumcount())])
    return facts


def object_tokens(tokenizer, answer: str, obj: str, n_tokens: int) -> list[int]:
    """Indices of the answer tokens that spell ``obj`` (e.g. ' H', 'ano', 'i' for "Hanoi"), cut at
    ``n_tokens``: the tokens of the answer up to the object's last occurrence, minus those before it."""
    start = answer.rfind(obj)
    before = tokenizer(answer[:start].rstrip(), add_special_tokens=False)["input_ids"]
    upto = tokenizer(answer[:start + len(obj)], add_special_tokens=False)["input_ids"]
    return list(range(len(before), min(len(upto), n_tokens)))


def draw_facts(facts, n_per_relation: int, seed: int = 0):
    """Up to ``n_per_relation`` facts drawn from *each* relation (all of a smaller relation), seeded.

    The draws are pandas' ``facts.groupby("relation").sample(n, random_state=seed)`` wherever
    every relation has at least ``n`` facts (one ``RandomState`` consumed relation by relation,
    in sorted order); a relation with fewer facts gives all of them instead of cutting every
    relation to its size.

    Args:
        facts: a fact table (:func:`load_facts`).
        n_per_relation: facts per relation, >= 0; 0 keeps every fact.

    Returns:
        The drawn rows grouped by relation, with a fresh index ``0..N-1``.
    """
    if isinstance(n_per_relation, bool) or not isinstance(n_per_relation, (int, np.integer)) or n_per_relation < 0:
        raise ValueError(f"n_per_relation must be an integer >= 0 (0: every fact), got {n_per_relation!r}")
    if "relation" not in facts.columns:
        raise ValueError(f"facts must have a 'relation' column, got {list(facts.columns)}")
    import pandas as pd
    if not n_per_relation:
        return facts.reset_index(drop=True)
    state = np.random.RandomState(seed)
    parts = [group.sample(n=min(n_per_relation, len(group)), random_state=state)
             for _, group in facts.groupby("relation")]
    return (pd.concat(parts) if parts else facts.iloc[:0]).reset_index(drop=True)


def swap_subject(text: str, old: str, new: str) -> str:
    """``text`` with every ``old`` replaced by ``new`` (case-insensitive; where the matched text starts
    with a capital, so does the replacement)."""
    import re
    return re.sub(re.escape(old), lambda m: new[0].upper() + new[1:] if m.group(0)[0].isupper() else new,
                  text, flags=re.IGNORECASE)


def corrupt_subject(tokenizer, fact, pool, *, length: int, answer_prefix: str = "", chat: bool = True,
                    seed: int = 0) -> tuple[Optional[torch.Tensor], Optional[str], bool]:
    """A subject-swap corruption: the same prompt with another subject of the same relation.

    Candidates are the ``pool`` facts of ``fact``'s relation with another subject and another
    object (case-insensitive), in a seeded random order. Each gives the token ids of the prompt
    with the subject swapped (chat template as :func:`iglens_data.encode`) followed by
    ``answer_prefix`` with the subject swapped (the answer up to the predicting position). The
    first candidate whose ids have ``length`` tokens wins (every position then aligns with the
    clean sequence); without one, the first candidate.

    Args:
        fact: one fact (a DataFrame row, a row of ``itertuples()`` or a dict) with ``relation``,
            ``subject``, ``prompt`` and ``object``.
        pool: the facts to draw the other subject from (e.g. the whole file).
        length: the clean sequence's length through its predicting position.
        answer_prefix: text of the answer before the predicted token ("" for a prompt alone).
        seed: order of the candidates.

    Returns:
        ``(ids (1, L') long, other subject, L' == length)``, or ``(None, None, False)`` when the
        relation has no other subject with another object.
    """
    from iglens_data import prompt_token_ids
    get = (lambda key: fact[key]) if isinstance(fact, dict) else (lambda key: getattr(fact, key))
    relation, subject, prompt, obj = (get(key) for key in FACT_COLUMNS)
    others = pool[(pool.relation == relation) & (pool.object.str.lower() != str(obj).lower())
                  & (pool.subject != subject)]
    first = None
    for other in others.sample(frac=1.0, random_state=seed).itertuples():
        text = swap_subject(answer_prefix, subject, other.subject)
        ids = prompt_token_ids(tokenizer, swap_subject(prompt, subject, other.subject), chat)
        ids = torch.tensor([ids + (tokenizer(text, add_special_tokens=False)["input_ids"] if text else [])])
        if ids.shape[1] == length:
            return ids, other.subject, True
        first = first or (ids, other.subject, False)
    return first if first else (None, None, False)


def tiny_model(arch: str = "llama", seed: int = 0, *, n_layers: int = 6, hidden_size: int = 32,
               vocab_size: int = 64, init_scale: float = 0.3):
    """A tiny randomly initialised causal LM built from a config (no download), for controlled checks.

    Norm weights (and biases, where the norm has them) are randomised: with unit norm weights
    some bugs are invisible. ``init_scale`` is the weights' standard deviation; 0.3 makes the
    output distribution far from uniform, so probabilities move along the path.

    Args:
        arch: ``"llama"`` (RMSNorm, rotary) or ``"gpt2"`` (LayerNorm with bias, learned positions).
        seed: seed of the weights.

    Returns:
        The model, float32, in eval mode.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    quiet_transformers()
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, initializer_range=init_scale,
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=n_layers, n_head=4,
                            n_positions=128, initializer_range=init_scale)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("ln_"):
                if name.endswith("weight"):
                    param.copy_(1.0 + 0.5 * torch.randn_like(param))
                else:
                    param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def word_spans(tokenizer, ids: Sequence[int], word: str) -> list[tuple[int, int]]:
    """Token spans ``(start, stop)`` of every occurrence of ``word`` in ``decode(ids)``, in order
    (case-insensitive, as :func:`iglens_data.token_span`); ``[]`` when it does not occur. The last
    subject token of a sequence is ``word_spans(...)[-1][1] - 1``."""
    from iglens_data import token_span
    ids = [int(i) for i in ids]
    spans, start = [], 0
    while start < len(ids):
        found = token_span(tokenizer, ids[start:], word)
        if found is None:
            break
        spans.append((start + found[0], start + found[1]))
        start += found[1]
    return spans


def answered_facts(model, tokenizer, facts, *, chat: bool = True, max_new_tokens: int = 12,
                   batch_size: int = 16) -> list:
    """The facts the model answers with their object, for tracing (notebooks 09 and 13).

    Each prompt (chat template as :func:`iglens_data.encode` when ``chat``) is answered greedily
    (:func:`iglens_data.greedy_answers`, batch-free: the same answer alone or in any batch); a fact is
    kept when its answer contains the object's tokens.

    Returns:
        ``[(row, ids (1, P + A) long, P, (start, stop))]``: the ``facts.itertuples()`` row, the prompt's
        and answer's token ids, the prompt's length P and the object's token span in the answer.
    """
    from iglens_data import encode, greedy_answers, token_span
    prompts = [encode(tokenizer, p, "x", chat=chat) for p in facts.prompt]   # the placeholder answer is dropped
    prompts = [ids[0, :length].tolist() for ids, length in prompts]
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    spans = [token_span(tokenizer, a, obj) if a else None for a, obj in zip(answers, facts.object)]
    return [(item, torch.tensor([p + a]), len(p), span) for item, p, a, span
            in zip(facts.itertuples(), prompts, answers, spans) if span is not None]


def trace_setup(tokenizer, item, pool, ids: torch.Tensor, prompt_len: int, span, *, chat: bool = True,
                rng: np.random.Generator):
    """One answered fact's clean and corrupted runs, as notebook 09 traces them (and 13 reads them).

    The focus token is the object's first token, predicted at ``focus - 1``; the corruption swaps the
    subject (:func:`corrupt_subject`, one draw from ``rng`` orders the candidates) in the prompt and
    in the answer up to the focus token.

    Returns:
        a dict ``clean`` (1, focus) and ``corrupted`` (1, focus) ids, ``target`` (the focus token's id),
        ``focus``, ``subject`` (the last subject token's position, of its last mention before the
        predicting position), ``positions`` (every subject token's position before it) and
        ``subject_spans``; or the reason it cannot be traced, ``"no same-length subject"`` or
        ``"subject not found"``.
    """
    focus = prompt_len + span[0]
    clean, target = ids[:, :focus], int(ids[0, focus])
    corrupted, _, aligned = corrupt_subject(tokenizer, item, pool, length=focus, chat=chat, seed=int(rng.integers(1 << 31)),
                                            answer_prefix=tokenizer.decode(ids[0, prompt_len:focus]))
    spans = [[int(a), int(b)] for a, b in word_spans(tokenizer, clean[0], item.subject)]
    if corrupted is None or not aligned:
        return "no same-length subject"
    if not spans or spans[-1][1] - 1 >= focus - 1:
        return "subject not found"
    return dict(clean=clean, corrupted=corrupted, target=target, focus=focus, subject=spans[-1][1] - 1,
                positions=[s for a, b in spans for s in range(a, b) if s < focus - 1], subject_spans=spans)
