"""Helpers of notebooks 08 and 09 (where the answer comes from; source maps against causal tracing):
top parts of a grid, word spans, the source-map figure."""
import numpy as np
import pytest
import torch

import iglens_baselines as igb
import iglens_stats as igs
import iglens_facts as igf
import iglens_core as ig
import iglens_plot as igp


def test_top_positive_ranks_a_grid_by_flat_index():
    rng = np.random.default_rng(0)
    values = rng.permutation(np.linspace(-1.0, 1.0, 60)).reshape(3, 4, 5)  # steps of 0.034
    want = np.argsort(-values.ravel())[:7]
    assert igs.top_positive(values, 7).tolist() == want.tolist()
    block, head, source = np.unravel_index(igs.top_positive(values, 1)[0], values.shape)
    assert values[block, head, source] == values.max()
    # the most negative parts, by the same rule
    assert igs.top_positive(-values, 3).tolist() == np.argsort(values.ravel())[:3].tolist()
    # ties within the tolerance go to the lower flat index; parts tied with zero never come back
    grid = np.zeros((2, 3, 4))
    grid[1, 2, 3], grid[0, 1, 0], grid[1, 0, 0] = 0.5, 0.5 + 1e-7, 3e-6
    assert igs.top_positive(grid, 10).tolist() == [np.ravel_multi_index((0, 1, 0), grid.shape),
                                                   np.ravel_multi_index((1, 2, 3), grid.shape)]


def test_word_spans_finds_every_occurrence(packaged):
    _, tokenizer = packaged
    text = "Vietnam lies in Asia. The capital of vietnam is Hanoi, and Vietnam's"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = igf.word_spans(tokenizer, ids, "Vietnam")
    assert len(spans) == text.lower().count("vietnam") == 3
    for start, stop in spans:
        assert "vietnam" in tokenizer.decode(ids[start:stop]).lower()
        assert "vietnam" not in tokenizer.decode(ids[start + 1:stop]).lower()  # the span starts with it
        assert "vietnam" not in tokenizer.decode(ids[start:stop - 1]).lower()  # and ends with it
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)
    assert igf.word_spans(tokenizer, ids, "Laos") == []


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


# ---- notebook 09: the controls and the per-item scores ----

from conftest import blocks, tiny_model  # noqa: E402

LAYOUT = {  # found here by name, independently of the core: value module, cut, output projection
    "llama": ("self_attn.v_proj", lambda out: out.view(len(out), 2, -1).repeat_interleave(2, 1), "self_attn.o_proj"),
    "gpt2": ("attn.c_attn", lambda out: out[:, 64:].view(len(out), 4, -1), "attn.c_proj"),
}


@pytest.mark.parametrize("arch", list(LAYOUT))
def test_attention_norm_equals_eager_attention_by_hand(arch):
    torch.set_grad_enabled(False)
    model = tiny_model(arch, seed=5, dtype=torch.float64)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(6))
    trace = ig.collect_components(model, ids, 6, sources=True)
    got = igb.attention_norm(model, trace)
    value_name, cut, out_name = LAYOUT[arch]
    values = {}
    hooks = [block.get_submodule(value_name).register_forward_hook(
        lambda m, a, o, i=i: values.__setitem__(i, cut(o[0]))) for i, block in enumerate(blocks(model))]
    out = model(ids, output_attentions=True)
    for hook in hooks:
        hook.remove()
    positions = trace.positions
    for layer, block in enumerate(blocks(model)):
        proj = block.get_submodule(out_name)
        weight = proj.weight.T if arch == "gpt2" else proj.weight  # (d, H * hd)
        pattern = out.attentions[layer][0][:, positions]  # (H, T, S)
        for h in range(4):
            written = values[layer][:, h] @ weight[:, h * 8:(h + 1) * 8].T  # (S, d)
            want = pattern[h] * written.norm(dim=-1)[None]  # (T, S)
            torch.testing.assert_close(got[:, layer, h], want, rtol=1e-9, atol=1e-12)
    assert (got >= 0).all() and float(got.max()) > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_source_dla_adds_up_to_head_dla(arch):
    torch.set_grad_enabled(False)
    model = tiny_model(arch, seed=7, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(8))
    trace = ig.collect_components(model, ids, 5, sources=True)
    per_source = igb.component_dla(model, trace, resolution="source")
    heads = igb.component_dla(model, trace, resolution="head")
    assert per_source.shape == (len(trace.targets), trace.n_layers, 4, ids.shape[1])
    assert float(per_source.abs().max()) > 1e-3
    torch.testing.assert_close(per_source.sum(-1), heads[..., :-1], atol=1e-10, rtol=0)
    after = torch.arange(ids.shape[1])[None, :] > trace.positions[:, None]
    assert float(per_source.abs().amax((1, 2))[after].max()) == 0.0


def test_restoration_last():
    rows = np.array([[0.9, 0.8, 0.6, 0.5 - 1e-7, 0.2, 0.0],   # falls below half after node 3 (tied)
                     [0.1, 0.2, 0.1, 0.0, 0.0, 0.0],          # never half
                     [0.0, 0.1, 0.3, 0.7, 0.9, 1.0]])         # rises: the last node
    assert igs.restoration_last(rows).tolist() == [3, -1, 5]
    assert igs.restoration_last(rows, 0.15).tolist() == [4, 1, 5]
    with pytest.raises(ValueError, match="level"):
        igs.restoration_last(rows, 0.0)


def _grid(S=7, n=5, subject=3, last_half=2, seed=0):
    """A causal trace grid: the subject row restores 0.9 up to node ``last_half`` then falls, the last
    row rises to 1, the rest 0."""
    r = np.zeros((S, n + 1))
    r[subject, :last_half + 1], r[subject, last_half + 1:] = 0.9, 0.1
    r[S - 1] = np.linspace(0.0, 1.0, n + 1)
    return r


def test_source_route_scores_on_a_constructed_item():
    n, H, S, subject = 5, 3, 7, 3
    parts = np.zeros((n, H, S))
    parts[4, 1, S - 1] = 0.30      # the top route: the last position, block 5
    parts[2, 2, subject] = 0.10    # from the subject: block 3 (the trace's block: node 2 + 1)
    parts[1, 0, subject] = 0.10 - 1e-8  # tied with it: the earlier block wins
    parts[0, 0, 0] = -0.05
    scores = igs.source_route_scores(parts, _grid(S, n, subject, last_half=2), subject)
    assert (scores["top_block"], scores["top_head"], scores["top_source"]) == (5, 1, S - 1)
    assert scores["top_from_last"] == 1.0 and scores["top_from_subject"] == 0.0
    assert (scores["subject_block"], scores["trace_block"]) == (2.0, 3.0)
    assert scores["distance"] == 1.0 and scores["within2"] == 1.0 and scores["names_subject_block"] == 1.0
    # Spearman over positions: the per-position totals against the strongest restoration, by hand
    from scipy.stats import spearmanr
    want = spearmanr(parts.sum((0, 1)), _grid(S, n, subject, 2)[:, :n].max(1)).statistic
    assert scores["spearman_positions"] == pytest.approx(want, abs=1e-12)
    tied = parts.sum(1).round(6).ravel()  # the 1e-8 tie counts as a tie
    grid = spearmanr(tied, _grid(S, n, subject, 2)[:, :n].T.ravel()).statistic
    assert scores["spearman_grid"] == pytest.approx(grid, abs=1e-12)
    # nothing read from the subject, and a subject row that never reaches half: NaN, not a guess
    parts[:, :, subject] = 1e-7
    r = _grid(S, n, subject, 2)
    r[subject] = 0.2
    empty = igs.source_route_scores(parts, r, subject)
    assert empty["names_subject_block"] == 0.0 and np.isnan(empty["subject_block"])
    assert np.isnan(empty["trace_block"]) and np.isnan(empty["distance"]) and np.isnan(empty["within2"])
    with pytest.raises(ValueError, match="subject must be"):
        igs.source_route_scores(parts, r, S - 1)
    with pytest.raises(ValueError, match="restoration"):
        igs.source_route_scores(parts, r[:, :-1], subject)


def test_any_subject_token_counts_a_first_name_route():
    n, H, S, subject = 4, 2, 8, 4
    parts = np.zeros((n, H, S))
    parts[2, 1, 2] = 0.4  # the top route reads the first token of a two-token name (positions 2..4)
    r = _grid(S, n, subject, last_half=1)
    last_only = igs.source_route_scores(parts, r, subject)
    spanned = igs.source_route_scores(parts, r, subject, subject_positions=[2, 3, 4])
    assert last_only["top_from_subject"] == 0.0 and last_only["top_from_any_subject"] == 0.0
    assert spanned["top_from_subject"] == 0.0 and spanned["top_from_any_subject"] == 1.0
    with pytest.raises(ValueError, match="include subject"):
        igs.source_route_scores(parts, r, subject, subject_positions=[2, 3])


def test_state_map_scores_on_a_constructed_item():
    """Each metric by hand on a (node, position) map built so that every answer is known."""
    from scipy.stats import spearmanr
    n, S, subject = 6, 7, 3
    r = _grid(S, n, subject, last_half=3)  # restoring the subject holds >= 0.5 up to node 3: block 4
    carried = np.zeros((n + 1, S))
    carried[:4, subject] = [0.1, 0.5, 0.6, 0.35]  # peak 0.6, half of it last held at node 3: block 4
    carried[:2, 1] = 0.2  # another subject token (a first name)
    carried[n, S - 1] = 1.0  # node n: the predicting position only, left out of every metric
    carried[5, S - 1] = 0.9
    scores = igs.state_map_scores(carried, r, subject, subject_positions=[1, 2, 3])
    assert scores["top_source"] == subject and scores["top_from_subject"] == 1.0
    assert scores["top_from_any_subject"] == 1.0
    assert scores["subject_peak"] == pytest.approx(0.6) and scores["any_subject_peak"] == pytest.approx(0.7)
    assert (scores["map_block"], scores["trace_block"], scores["distance"], scores["within2"]) == (4.0, 4.0, 0.0, 1.0)
    want = spearmanr(carried[:n, :S - 1].ravel(), r[:S - 1, :n].T.ravel()).statistic
    assert scores["spearman_grid"] == pytest.approx(want, abs=1e-12)
    want = spearmanr(carried[:n, :S - 1].max(0), r[:S - 1, :n].max(1)).statistic
    assert scores["spearman_positions"] == pytest.approx(want, abs=1e-12)
    # the largest cell at a first-name token: from any subject token, not from the last one
    carried[0, 1] = 0.8
    moved = igs.state_map_scores(carried, r, subject, subject_positions=[1, 2, 3])
    assert (moved["top_from_subject"], moved["top_from_any_subject"]) == (0.0, 1.0)
    # a map whose subject column is 0 names no block
    carried[:, subject] = 0.0
    empty = igs.state_map_scores(carried, r, subject)
    assert np.isnan(empty["map_block"]) and np.isnan(empty["distance"])
    with pytest.raises(ValueError, match="state_map must be"):
        igs.state_map_scores(carried[:, :-1], r, subject)
    with pytest.raises(ValueError, match="finite"):
        igs.state_map_scores(np.full_like(carried, np.nan), r, subject)
    with pytest.raises(ValueError, match="subject must be"):
        igs.state_map_scores(carried, r, S - 1)


def test_source_vs_trace_figure_draws_both_grids():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rng = np.random.default_rng(3)
    source_map, restoration = rng.normal(size=(4, 6)), rng.random((6, 5))
    fig = igp.plot_source_vs_trace(source_map, restoration, [f"t{i}" for i in range(6)], highlight=[2])
    ax_map, ax_trace = [ax for ax in fig.axes if ax.images][:2]
    np.testing.assert_array_equal(ax_map.images[0].get_array(), source_map)
    np.testing.assert_array_equal(ax_trace.images[0].get_array(), restoration.T)
    plt.close(fig)
    with pytest.raises(ValueError, match="restoration must be"):
        igp.plot_source_vs_trace(source_map, restoration[:, :-1], [f"t{i}" for i in range(6)])


def test_carried_vs_trace_figure_draws_both_node_grids():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rng = np.random.default_rng(4)
    carried, restoration = rng.normal(size=(5, 6)), rng.random((6, 5))  # nodes 0..4 on both
    fig = igp.plot_carried_vs_trace(carried, restoration, [f"t{i}" for i in range(6)], highlight=[1])
    ax_map, ax_trace = [ax for ax in fig.axes if ax.images][:2]
    np.testing.assert_array_equal(ax_map.images[0].get_array(), carried)
    np.testing.assert_array_equal(ax_trace.images[0].get_array(), restoration.T)
    assert ax_map.images[0].get_extent()[2:] == [4.5, -0.5]  # node 0 at the top, as the trace
    plt.close(fig)
    with pytest.raises(ValueError, match="restoration must be"):
        igp.plot_carried_vs_trace(carried[1:], restoration, [f"t{i}" for i in range(6)])


def test_graph_figure_draws_every_node_and_link():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from collections import namedtuple
    Node = namedtuple("Node", "kind block position index share")
    nodes = [Node("embedding", 0, 1, 0, 0.1), Node("head", 2, 4, 3, 0.3), Node("neuron", 3, 4, 7, -0.2)]
    links = [(1, 2, 4, 0.25), (0, 2, 4, -0.05)]
    fig = igp.plot_graph(nodes, links, [f"t{i}" for i in range(5)], 3, title="g")
    ax = fig.axes[0]
    assert len(ax.lines) == len(links) and len(ax.collections) == 3  # one scatter per kind
    assert [tuple(line.get_xydata()[:, 0]) for line in ax.lines] == [(1.0, 4.0), (0.0, 4.0)]
    plt.close(fig)
    with pytest.raises(ValueError, match="at least one node"):
        igp.plot_graph([], links, ["a"], 3)


def test_patching_curve_scores_against_a_hand_count():
    """The map's column at the predicting position against the trace's last row, counted by hand: scipy's
    Spearman on untied values, and the first node reaching half read off directly."""
    from scipy.stats import spearmanr
    rng = np.random.default_rng(3)
    n, S = 9, 6
    restoration = rng.random((S, n + 1))
    restoration[-1] = np.r_[np.sort(rng.random(n)) * 0.9, 1.0]  # a rising patching curve
    state_map = rng.random((n + 1, S))
    state_map[:, -1] = np.r_[rng.permutation(np.linspace(0.05, 0.95, n)), 1.0]
    got = igs.patching_curve_scores(state_map, restoration)
    assert got["patching_spearman"] == pytest.approx(spearmanr(state_map[:n, -1], restoration[-1, :n]).statistic, abs=1e-12)
    first = lambda row: next(L for L, v in enumerate(row) if v >= 0.5)
    assert got["patching_half_distance"] == abs(first(state_map[:, -1]) - first(restoration[-1]))
    assert got["patching_within2"] == float(got["patching_half_distance"] <= 2)
    same = igs.patching_curve_scores(restoration.T, restoration)
    assert same["patching_spearman"] == pytest.approx(1.0) and same["patching_half_distance"] == 0.0
    with pytest.raises(ValueError, match="state_map"):
        igs.patching_curve_scores(state_map[:, :-1], restoration)


def test_plot_paired_scores_counts_only_scored_pairs():
    """One panel per readout; the title counts the facts above the diagonal among those both maps scored
    (a NaN score, a map all ties, is left out), against a count by hand."""
    import pandas as pd
    rows = [dict(id=i, readout=r, method=m, spearman_grid=v) for i, r, m, v in [
        (0, "p", "graph", 0.9), (0, "p", "AtP", 0.5), (1, "p", "graph", 0.2), (1, "p", "AtP", np.nan),
        (0, "log p", "graph", 0.1), (0, "log p", "AtP", 0.4), (1, "log p", "graph", 0.8), (1, "log p", "AtP", 0.7)]]
    fig = igp.plot_paired_scores(pd.DataFrame(rows), metric="spearman_grid", method="graph", against="AtP",
                                 panel="readout", title="t")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["p: above the diagonal 1 of 1", "log p: above the diagonal 1 of 2"]
    assert [len(ax.collections[0].get_offsets()) for ax in fig.axes] == [1, 2]
