"""Helpers of notebooks 08 and 09 (where the answer comes from; source maps against causal tracing):
top parts without zero-tied ones, word spans, the source-map figure."""
import numpy as np
import pytest
import torch

import iglens_compare as cmp
import iglens_core as ig
import iglens_plot as igp


def test_top_parts_is_argsort_of_the_flattened_parts_when_separated():
    rng = np.random.default_rng(0)
    values = rng.permutation(np.linspace(-1.0, 1.0, 60)).reshape(3, 4, 5)  # steps of 0.034
    want = np.argsort(-values.ravel())[:7]
    assert cmp.top_parts(values, 7).tolist() == want.tolist()
    want_abs = np.argsort(-np.abs(values.ravel()), kind="stable")[:7]
    got_abs = cmp.top_parts(values, 7, by="abs")
    assert sorted(np.abs(values.ravel())[got_abs]) == pytest.approx(sorted(np.abs(values.ravel())[want_abs]))
    block, head, source = np.unravel_index(cmp.top_parts(values, 1)[0], values.shape)
    assert values[block, head, source] == values.max()


def test_top_parts_breaks_ties_by_lower_index_and_never_picks_zero_tied_parts():
    values = np.zeros((2, 3, 4))
    values[1, 2, 3] = 0.5
    values[0, 1, 0] = 0.5 + 1e-7           # tied with 0.5 by the rank tolerance: the lower index wins
    values[1, 0, 0] = 3e-6                 # tied with zero: never picked
    values[0, 0, 2] = -0.2                 # negative: not among the largest values, but by |value|
    assert cmp.top_parts(values, 10).tolist() == [np.ravel_multi_index((0, 1, 0), values.shape),
                                                  np.ravel_multi_index((1, 2, 3), values.shape)]
    by_abs = cmp.top_parts(values, 10, by="abs")
    assert by_abs.tolist()[-1] == np.ravel_multi_index((0, 0, 2), values.shape) and len(by_abs) == 3
    assert cmp.top_parts(np.zeros(5), 3).tolist() == []
    # a float-path perturbation far below the tolerance changes nothing
    noisy = values * (1 + 1e-9 * np.random.default_rng(1).standard_normal(values.shape))
    assert cmp.top_parts(noisy, 10).tolist() == cmp.top_parts(values, 10).tolist()


def test_top_parts_bad_input():
    with pytest.raises(ValueError, match="by must be"):
        cmp.top_parts(np.ones(3), 1, by="max")
    with pytest.raises(ValueError, match="k must be"):
        cmp.top_parts(np.ones(3), 0)
    with pytest.raises(ValueError, match="without NaN"):
        cmp.top_parts(np.array([1.0, np.nan]), 1)


def test_word_spans_finds_every_occurrence(packaged):
    _, tokenizer = packaged
    text = "Vietnam lies in Asia. The capital of vietnam is Hanoi, and Vietnam's"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = cmp.word_spans(tokenizer, ids, "Vietnam")
    assert len(spans) == text.lower().count("vietnam") == 3
    for start, stop in spans:
        assert "vietnam" in tokenizer.decode(ids[start:stop]).lower()
        assert "vietnam" not in tokenizer.decode(ids[start + 1:stop]).lower()  # the span starts with it
        assert "vietnam" not in tokenizer.decode(ids[start:stop - 1]).lower()  # and ends with it
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)
    assert cmp.word_spans(tokenizer, ids, "Laos") == []


def test_source_map_figure_draws_the_map_and_the_totals():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rng = np.random.default_rng(2)
    source_map = rng.normal(size=(6, 9))
    tokens = ["<s>", "The", " capital", "\n", " ", "of", " Viet", "nam", " is"]
    fig = igp.plot_source_map(source_map, tokens, highlight=[6, 7], rest=0.25, title="t")
    ax_sum, ax = fig.axes[:2]
    np.testing.assert_array_equal(ax.images[0].get_array(), source_map)
    assert [bar.get_height() for bar in ax_sum.patches] == pytest.approx(source_map.sum(0).tolist())
    norm = ax.images[0].norm
    assert norm.vmin == -norm.vmax == -np.abs(source_map).max()       # centred at zero
    labels = [label.get_text() for label in ax.get_xticklabels()]
    assert labels[3] == "\\n" and labels[4] == "␣" and labels[6] == " Viet"
    assert [label.get_color() for label in ax.get_xticklabels()][6:8] == ["tab:red"] * 2
    assert "+0.250" in ax_sum.get_title()
    plt.close(fig)
    with pytest.raises(ValueError, match="one label per source position"):
        igp.plot_source_map(source_map, tokens[:-1])
