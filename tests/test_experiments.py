"""The experiment helpers of notebooks 05 and 08: fact tables, draws, subject swaps, bootstrap tables."""
import numpy as np
import pandas as pd
import pytest

import iglens_data as igd
import iglens_stats as igs
import iglens_facts as igf


def _facts(sizes, seed=0):
    rng = np.random.default_rng(seed)
    rows = [dict(relation=relation, subject=f"{relation}-s{i}", prompt=f"Where is {relation}-s{i}?",
                 answer=f"It is in o{i % 3}.", object=f"o{i % 3}", value=rng.random())
            for relation, size in sizes.items() for i in range(size)]
    return pd.DataFrame(rows).sample(frac=1.0, random_state=seed)  # shuffled, index kept


def test_draw_takes_up_to_n_from_each_relation():
    facts = _facts({"capital": 6, "currency": 1, "language": 3, "river": 9})
    drawn = igf.draw_facts(facts, 4, seed=3)
    counts = drawn.relation.value_counts()
    sizes = facts.relation.value_counts()
    for relation in sizes.index:  # not the smallest relation's size for all
        assert counts[relation] == min(4, sizes[relation])
    assert not drawn.duplicated().any()
    assert set(map(tuple, drawn.to_numpy())) <= set(map(tuple, facts.to_numpy()))  # real rows
    assert list(drawn.index) == list(range(len(drawn)))
    assert len(igf.draw_facts(facts, 0)) == len(facts)
    other = igf.draw_facts(facts, 4, seed=4)
    assert not drawn.equals(other)  # seeded: another seed, another draw


@pytest.mark.parametrize("seed", [0, 7])
def test_draw_matches_pandas_groupby_sample_when_every_relation_is_large_enough(seed):
    facts = _facts({"capital": 6, "language": 5, "river": 9}, seed=seed)
    expected = facts.groupby("relation").sample(n=4, random_state=seed).reset_index(drop=True)
    pd.testing.assert_frame_equal(igf.draw_facts(facts, 4, seed=seed), expected)


def test_draw_and_load_bad_input(tmp_path):
    facts = _facts({"capital": 3})
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="n_per_relation"):
            igf.draw_facts(facts, bad)
    with pytest.raises(ValueError, match="relation"):
        igf.draw_facts(facts.drop(columns="relation"), 2)
    path = tmp_path / "facts.csv"
    facts.drop(columns="object").to_csv(path, index=False)
    with pytest.raises(ValueError, match="object"):
        igf.load_facts(path)
    broken = facts.copy()
    broken.loc[broken.index[1], "answer"] = "Nowhere."
    with pytest.raises(ValueError, match="Nowhere"):
        igf.load_facts(broken, statement=True)


def test_load_facts_statement_mode(tmp_path):
    facts = _facts({"capital": 3, "river": 2})
    path = tmp_path / "facts.csv"
    facts.to_csv(path, index=False)
    loaded = igf.load_facts(path, statement=True)
    for row, original in zip(loaded.itertuples(), facts.answer):
        assert row.prompt + row.answer == original            # the answer, cut before its object
        assert row.answer == " " + row.object + "."          # the rest, with its leading space
    assert list(igf.load_facts(path).prompt) == list(facts.prompt)
    # a file without ids gets <relation>_<k>, k counted within the relation in file order
    facts.drop(columns="id", errors="ignore").iloc[[0, 3, 1, 4, 2]].to_csv(path, index=False)
    assert list(igf.load_facts(path).id) == ["capital_001", "river_001", "capital_002", "river_002", "capital_003"]


def test_swap_subject_keeps_case():
    assert igf.swap_subject("France: the capital of france", "France", "greece") == \
        "Greece: the capital of greece"
    assert igf.swap_subject("no subject here", "France", "Greece") == "no subject here"
    assert igf.swap_subject("a+b and A+B", "a+b", "c") == "c and C"  # not a regular expression


def test_corrupt_subject(packaged):
    _, tokenizer = packaged
    pool = pd.DataFrame([
        dict(relation="capital", subject="France", prompt="What is the capital of France?", object="Paris"),
        dict(relation="capital", subject="Greece", prompt="What is the capital of Greece?", object="Athens"),
        dict(relation="capital", subject="Burkina Faso", prompt="-", object="Ouagadougou"),
        dict(relation="capital", subject="Texas", prompt="-", object="paris"),  # same object: excluded
        dict(relation="river", subject="Spain", prompt="-", object="Ebro"),  # another relation: excluded
    ])
    fact = pool.iloc[0]
    clean, prompt_len = igd.encode(tokenizer, fact.prompt, "The capital of France is Paris.")
    focus = prompt_len + igd.token_span(tokenizer, clean[0, prompt_len:], "Paris")[0]
    prefix = tokenizer.decode(clean[0, prompt_len:focus])
    for seed in range(4):  # whatever the order, the same-length subject wins
        ids, other, aligned = igf.corrupt_subject(tokenizer, fact, pool, length=focus, answer_prefix=prefix, seed=seed)
        assert (other, aligned) == ("Greece", True)
        expected, _ = igd.encode(tokenizer, "What is the capital of Greece?", "The capital of Greece is Paris.")
        assert ids.tolist() == expected[:, :focus].tolist()
    ids, other, aligned = igf.corrupt_subject(tokenizer, dict(fact),
                                              pool[pool.subject != "Greece"], length=focus, answer_prefix=prefix)
    assert other == "Burkina Faso" and not aligned and ids.shape[1] != focus
    assert igf.corrupt_subject(tokenizer, fact, pool[pool.subject.isin(["France", "Texas"])], length=focus) == \
        (None, None, False)


def test_bootstrap_table_against_bootstrap_ci():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(dict(method=rng.choice(["b", "a", "c"], 60), mode=rng.choice(["zero", "mean"], 60),
                              x=rng.random(60), y=rng.normal(size=60)))
    frame.loc[3, "y"] = np.nan
    table = igs.bootstrap_table(frame, ["mode", "method"], ["x", "y"], order={"method": ["c", "a", "b"]},
                                n_boot=200, seed=1)
    modes = list(pd.unique(frame["mode"]))
    keys = [(mode, method) for mode in modes for method in "cab"]
    assert list(zip(table["mode"], table.method)) == keys
    for row, (mode, method) in zip(table.itertuples(), keys):
        group = frame[(frame["mode"] == mode) & (frame.method == method)]
        assert row.items == len(group)
        for metric in ("x", "y"):
            est, low, high = igs.bootstrap_ci(group[metric].to_numpy(), n_boot=200, seed=1)
            assert getattr(row, metric) == f"{est:.2f} [{low:.2f}, {high:.2f}]"
    values = [0.5, -0.25, 0.1]
    est, low, high = igs.bootstrap_ci(values, n_boot=50)
    assert igs.format_ci(values, n_boot=50, signed=True) == f"{est:+.2f} [{low:+.2f}, {high:+.2f}]"


def test_object_tokens_spell_the_object(packaged):
    """The indices cover exactly the tokens whose text, joined, is the object (checked by decoding)."""
    _, tokenizer = packaged
    for answer, obj in [("The capital of Vietnam is Hanoi.", "Hanoi"), ("It is Paris", "Paris"),
                        ("Water is H2O, chemically.", "H2O")]:
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        picked = igf.object_tokens(tokenizer, answer, obj, len(ids))
        assert picked and tokenizer.decode([ids[i] for i in picked]).strip() == obj
        assert obj not in tokenizer.decode(ids[:picked[0]]) and picked[-1] < len(ids)
    assert igf.object_tokens(tokenizer, "The capital is Hanoi.", "Hanoi", 2) == []  # cut at n_tokens


def test_verdict_table_matches_format_ci():
    rng = np.random.default_rng(0)
    per_item = pd.DataFrame(dict(method=np.repeat(["a", "b"], 20), mode="zero",
                                 beats_median=rng.integers(0, 2, 40).astype(float), spearman=rng.normal(size=40)))
    per_patch = pd.DataFrame(dict(method=np.repeat(["a", "b"], 10), distance=rng.integers(0, 9, 20).astype(float),
                                  within2=rng.integers(0, 2, 20).astype(float), spearman_curve=rng.normal(size=20),
                                  spearman_steps=rng.normal(size=20)))
    table = igs.verdict_table(per_item, per_patch, ["b", "a"], ["zero"], n_boot=200, seed=1).set_index("method")
    assert list(table.index) == ["b", "a"]
    assert table.loc["a", "zero: Spearman"] == igs.format_ci(per_item.spearman[:20], n_boot=200, seed=1)
    assert table.loc["b", "patch: within 2"] == igs.format_ci(per_patch.within2[10:], n_boot=200, seed=1)
