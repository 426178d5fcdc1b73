"""attribute_dataset(resolution=, top_k=) and --resolution / --top-k: the parts table equals
components() of each item alone, adds up to Δp, resumes only with the same settings."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import iglens_cli as igcli
import iglens_core as ig
import iglens_data as igd
import iglens_graph as igg
import iglens_tables as igt
from conftest import order_tolerance, tiny_model
from test_dataset import VOCAB, model_dir, tokenizer  # noqa: F401 (fixtures: the packaged tokenizer, a tiny Llama dir)

ROOT = Path(__file__).resolve().parents[1]


def _facts(n=3):
    facts = pd.read_csv(ROOT / "data" / "facts.csv").sample(n, random_state=2)[["id", "prompt", "object"]]
    return facts.rename(columns={"object": "answer"}).reset_index(drop=True)


def _check_item(model, tokenizer, item, got, block_rows, resolution, top_k, foil=None, **settings):
    """One item's parts rows against components() of the item alone, computed here."""
    ids, prompt_len = igd.encode(tokenizer, item.prompt, item.answer)
    trace = ig.collect_components(model, ids, prompt_len, sources=resolution == "source")
    with torch.no_grad():  # components() does not switch gradients off itself (Gemma's post-norms)
        want = ig.components(model, trace, resolution=resolution, foil=foil, **settings)
    shares = (want.neurons if resolution == "neuron" else want.heads).double()  # (T, n, P + 1)
    split = want.sources.double() if resolution == "source" else shares[..., :-1]
    T = len(want.targets)
    assert sorted(got["token_index"].unique()) == list(range(T))
    for t in range(T):
        rows = got[got["token_index"] == t]
        delta_p = float(want.delta_p[t])
        assert rows["delta_p"].to_numpy() == pytest.approx(delta_p, abs=1e-12)
        # the block table's Δp is the same change of f
        assert block_rows[block_rows["token_index"] == t]["delta_p"].iloc[0] == pytest.approx(delta_p, abs=1e-5)
        whole = split[t].sum() + shares[t, :, -1].sum() + (want.attn if resolution == "neuron" else want.mlp)[t].double().sum()
        assert rows["parts_sum"].iloc[0] == pytest.approx(float(whole), abs=1e-9)
        # complete at float32, up to the estimator's float rounding that components() reports itself
        # (up to 1.5e-5 for the packaged model's 30 blocks at float32)
        own = want.residual_neurons if resolution == "neuron" else want.residual_heads
        assert abs(rows["parts_sum"].iloc[0] - delta_p) < 1e-5 + own
        top = rows[rows["kind"] == resolution]
        assert top["rank"].tolist() == list(range(1, len(top) + 1))
        at = [top["block"].to_numpy(int) - 1]
        at += ([top["neuron"].to_numpy(int)] if resolution == "neuron" else [top["head"].to_numpy(int)])
        at += [top["source_position"].to_numpy(int)] if resolution == "source" else []
        np.testing.assert_array_equal(top["share"].to_numpy(), split[t][tuple(at)].numpy())
        # the top k by |share| with the tie rule: none tied with 0, none left out that is larger
        size = split[t].abs().reshape(-1).numpy()
        tol = float(ig.tie_tolerance(size)[0])
        assert len(top) == min(top_k, int((size > tol).sum()))
        picked = np.ravel_multi_index(tuple(at), split[t].shape)
        left = np.delete(size, picked)
        assert (size[picked] > tol).all()
        assert len(top) < top_k or size[picked].min() >= left.max() - tol
        assert (np.diff(size[picked]) <= tol).all()  # in order, up to ties
        rest = rows[rows["kind"] == "rest"]["share"]
        assert len(rest) == 1 and rest.iloc[0] + top["share"].sum() == pytest.approx(delta_p, abs=1e-12)
        if resolution == "source":
            heads = rows[rows["kind"] == "head_total"]  # every head not tied with 0, in (block, head) order
            every = shares[t, :, :-1].reshape(-1).numpy()
            kept = np.abs(every) > ig.tie_tolerance(np.abs(every))[0]
            np.testing.assert_array_equal(heads["share"].to_numpy(), every[kept])
            H = shares.shape[-1] - 1
            np.testing.assert_array_equal((heads["block"].to_numpy(int) - 1) * H + heads["head"].to_numpy(int),
                                          np.flatnonzero(kept))
            totals = rows[rows["kind"] == "source_total"]
            moved = want.by_source()[t].double()
            position = int(want.positions[t])
            assert totals["source_position"].tolist() == list(range(position + 1))
            assert totals["source_token"].tolist() == [tokenizer.decode([i]) for i in ids[0, :position + 1].tolist()]
            np.testing.assert_array_equal(totals["share"].to_numpy(), moved[:position + 1].numpy())
            assert (moved[position + 1:-1] == 0).all()  # nothing moved from a later position
            source_rest = rows[rows["kind"] == "source_rest"]["share"].iloc[0]
            # the rest is Δp minus the float32 sum of the S position totals (by_source); here they are
            # summed in float64: two orders of one sum of S + 1 terms (1e-7 failed at 1 thread)
            tol = order_tolerance(torch.float32, float(moved.abs().sum()) + abs(delta_p), len(moved))
            assert source_rest + totals["share"].sum() == pytest.approx(delta_p, abs=tol)


# probabilities of a random model over 49152 tokens are ~2e-5: their shares are all tied with 0, so
# the tiny models split log-probabilities (nats) where parts must be picked; the packaged one, below, p
@pytest.mark.parametrize("arch,resolution,quantity", [("llama", "source", "logprob"), ("gemma3", "source", "logprob"),
                                                      ("gpt2", "head", "prob"), ("llama", "neuron", "logprob")])
def test_parts_equal_components_of_each_item(tokenizer, arch, resolution, quantity):
    model = tiny_model(arch, seed=7, vocab_size=VOCAB)
    facts = _facts()
    facts["foil"] = [None, " Lyon", None]
    top_k = 4
    results, errors, parts = igd.attribute_dataset(
        model, tokenizer, facts, steps=3, batch_size=2, progress=False, quantity=quantity,
        resolution=resolution, top_k=top_k)
    assert errors.empty and list(parts["id"].unique()) == list(facts["id"])
    kinds = {resolution, "rest"} | ({"head_total", "source_total", "source_rest"} if resolution == "source" else set())
    assert set(parts["kind"]) == (kinds if quantity == "logprob" else kinds - {resolution})
    assert (parts["quantity"] == quantity).all()
    for item in facts.itertuples():
        foil = tokenizer(item.foil, add_special_tokens=False)["input_ids"][0] if item.foil else None
        _check_item(model, tokenizer, item, parts[parts["id"] == item.id], results[results["id"] == item.id],
                    resolution, top_k, foil=foil, steps=3, estimator="prediction_aware", quantity=quantity)


def _logit_scale(model, ids, t: int) -> float:
    """The largest ``sum_i |W_vi y_i|`` over the vocabulary v and the two points the lens reads at
    position ``t`` (``y``: the final norm's output of h_0 and of h_n): the sum of |terms| of each
    logit's dot product, the reduction whose order the batched readout changes."""
    adapter = ig.get_adapter(model)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # the last one is already normed
        ys = torch.stack([adapter.norm(states[0][0, t]), states[-1][0, t]]).double()
        return float((ys.abs() @ adapter.head.weight.double().abs().T).max())


def _check_graph_item(model, tokenizer, item, got, block_rows, top_k, foil=None, **settings):
    """One item's graph rows against iglens_graph.attribution_graph of each answer token alone."""
    ids, prompt_len = igd.encode(tokenizer, item.prompt, item.answer)
    T = ids.shape[1] - prompt_len
    assert sorted(got["token_index"].unique()) == list(range(T))
    dtype = next(model.parameters()).dtype
    exact = dtype == torch.float64
    d = model.config.hidden_size
    for j in range(T):
        graph = igg.attribution_graph(model, ids, prompt_len, token=j, foil=foil, edges=False, **settings)
        rows = got[got["token_index"] == j]
        n, t = graph.n_layers, graph.position
        # The rows come from attribution_graphs over every answer token, the graph here from one token:
        # the same float32 pass, read out in batches of another size, so only the readout's float32
        # reductions change order. Δp = f(h_n) - f(h_0), each f read from logits whose dot products
        # (length d) move by at most eps * d * (their sum of |terms|): f (p or log p) by twice the
        # largest logit's move, Δp by twice that again. Every other number of the graph is the
        # float64 sweep, linear in the 2n segment gradients, each a float32 reduction over the
        # vocabulary (length V, W^T df/dz): scale = the largest |term| that entered the sweep
        # (top terms, carried cells, Δ). Measured under MKL_CBWR=COMPATIBLE at 2 threads: the sweep's
        # gaps up to 1.2e-2 of tol (GPT-2's p, whose gradient terms cancel most); Δp's 9.5e-7 of
        # issue 48 (AMD, 2 threads) is 1/11 of tol_dp (1.1e-5).
        if exact:
            tol_dp = tol = 1e-12 * max(float(graph.carried.abs().max()), abs(graph.delta), 1e-3)
        else:
            tol_dp = order_tolerance(dtype, 4 * _logit_scale(model, ids, t), d)
            largest = max(float(graph.carried.abs().max()), float(graph.attn_terms.abs().max()),
                          float(graph.mlp_terms.abs().max()), abs(graph.delta), abs(graph.delta_p))
            tol = order_tolerance(dtype, largest, model.config.vocab_size)
        assert (rows["position"] == t).all() and (rows["token"] == tokenizer.decode([graph.target])).all()
        assert rows["delta_p"].to_numpy() == pytest.approx(graph.delta_p, abs=tol_dp)
        assert rows["parts_sum"].to_numpy() == pytest.approx(graph.delta, abs=tol)
        assert abs(graph.delta - graph.delta_p) < (1e-12 if exact else 1e-5)  # prediction-aware
        assert block_rows[block_rows["token_index"] == j]["delta_p"].iloc[0] == pytest.approx(graph.delta_p, abs=1e-5)
        # the carried map, readable and constants above: the graph's, and every node adds up
        carried = rows[rows["kind"] == "carried"].pivot(index="node", columns="source_position", values="share")
        assert carried.index.tolist() == list(range(n + 1)) and carried.columns.tolist() == list(range(t + 1))
        np.testing.assert_allclose(carried.to_numpy(), graph.carried[:, :t + 1].numpy(), rtol=0, atol=tol)
        assert (graph.carried[:, t + 1:] == 0).all()  # nothing comes from later positions
        readable = rows[rows["kind"] == "readable"].set_index("node")["share"]
        above = rows[rows["kind"] == "constants_above"].set_index("node")["share"]
        np.testing.assert_allclose(readable.to_numpy(), graph.readable.numpy(), rtol=0, atol=tol)
        np.testing.assert_allclose(above.to_numpy(), graph.constants_above.numpy(), rtol=0, atol=tol)
        per_node = readable.to_numpy() + carried.to_numpy().sum(1) + above.to_numpy()
        np.testing.assert_allclose(per_node, rows["parts_sum"].iloc[0], rtol=0, atol=1e-12 if exact else 1e-5)
        # the top-k nodes: the graph's shares at the nodes named, picked by the tie rule
        flat = torch.cat([graph.embeddings, torch.tensor([graph.constants], dtype=torch.float64),
                          graph.heads.reshape(-1), graph.neurons.reshape(-1)]).numpy()
        S, H, d_ff = len(graph.embeddings), graph.heads.shape[1], graph.neurons.shape[-1]
        top = rows[rows["kind"].isin(igt.GRAPH_NODE_KINDS)]
        assert top["rank"].tolist() == list(range(1, len(top) + 1))
        picked = []
        for node in top.itertuples():
            if node.kind == "embedding":
                assert node.node == 0
                picked.append(node.source_position)
            elif node.kind == "constants":
                picked.append(S)
            elif node.kind == "head":
                picked.append(S + 1 + ((node.block - 1) * H + node.head) * S + node.source_position)
            else:
                picked.append(S + 1 + n * H * S + ((node.block - 1) * S + node.source_position) * d_ff + node.neuron)
        picked = np.array(picked, dtype=np.int64)
        np.testing.assert_allclose(top["share"].to_numpy(), flat[picked], rtol=0, atol=tol)
        size = np.abs(flat)
        tie = float(ig.tie_tolerance(size)[0])
        assert len(top) == min(top_k, int((size > tie).sum()))
        assert (size[picked] > tie).all() and (np.diff(size[picked]) <= tie).all()
        assert len(top) < top_k or size[picked].min() >= np.delete(size, picked).max() - tie
        rest = rows[rows["kind"] == "rest"]["share"]
        assert len(rest) == 1 and rest.iloc[0] + top["share"].sum() == pytest.approx(rows["delta_p"].iloc[0], abs=1e-12)
        assert set(rows["kind"]) <= {*igt.GRAPH_NODE_KINDS, "rest", "carried", "readable", "constants_above"}
        assert len(rows) == len(top) + 1 + (n + 1) * (t + 1) + 2 * (n + 1)


@pytest.mark.parametrize("arch,dtype,quantity", [("llama", torch.float64, "logprob"), ("gemma3", torch.float32, "logprob"),
                                                 ("gpt2", torch.float32, "prob")])
def test_graph_rows_equal_the_graph_of_each_token(tokenizer, arch, dtype, quantity):
    """resolution="graph": per item and answer token the carried map and the top-k nodes equal
    iglens_graph.attribution_graph's of that token computed alone; parts + rest add up to Δp; every
    node's rows add up to the top terms. Tiny random models with randomised norms; one item with a foil."""
    model = tiny_model(arch, seed=11, vocab_size=VOCAB, dtype=dtype)
    facts = _facts(2)
    facts["foil"] = [" Lyon", None]
    results, errors, parts = igd.attribute_dataset(model, tokenizer, facts, steps=3, batch_size=2, progress=False,
                                                   quantity=quantity, resolution="graph", top_k=6)
    assert errors.empty and list(parts["id"].unique()) == list(facts["id"])
    assert list(parts.columns) == igt.PART_COLUMNS[:-1] and (parts["quantity"] == quantity).all()
    assert parts[parts["kind"] == "carried"]["node"].min() == 0
    if quantity == "logprob":  # probabilities of a random model over 49152 tokens are all tied with 0
        assert set(parts["kind"]) & {"head", "neuron", "embedding"}
    for item in facts.itertuples():
        foil = tokenizer(item.foil, add_special_tokens=False)["input_ids"][0] if item.foil else None
        assert (parts[parts["id"] == item.id]["foil"].isna() if foil is None
                else parts[parts["id"] == item.id]["foil"] == item.foil).all()
        _check_graph_item(model, tokenizer, item, parts[parts["id"] == item.id], results[results["id"] == item.id],
                          6, foil=foil, steps=3, estimator="prediction_aware", quantity=quantity)


def test_cli_resolution_graph(tmp_path, model_dir, tokenizer, capsys):
    """``iglens --dataset F --resolution graph --top-k 3``: the summary names the graph rows and the
    parts file holds each answer token's graph (checked against attribution_graph as above)."""
    facts = _facts(2)
    csv, out = tmp_path / "items.csv", tmp_path / "g.parquet"
    facts.to_csv(csv, index=False)
    assert igcli.main(["--dataset", str(csv), "--out", str(out), "--model", str(model_dir), "--steps", "2",
                       "--quantity", "logprob", "--resolution", "graph", "--top-k", "3"]) == 0
    printed = capsys.readouterr().out
    parts = pd.read_parquet(igt.parts_path(out))
    assert f"{len(parts)} graph rows (top 3 per answer token, carried map, rest) in {igt.parts_path(out)}" in printed
    model, _ = ig.load_model(str(model_dir))
    results = pd.read_parquet(out)
    for item in facts.itertuples():
        _check_graph_item(model, tokenizer, item, parts[parts["id"] == item.id], results[results["id"] == item.id],
                          3, steps=2, estimator="prediction_aware", quantity="logprob")


def test_graph_frame_bad_top_k_and_mixed_sequences(tokenizer):
    model = tiny_model("llama", seed=2, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 1 \(nodes written per answer token\), got 0"):
        igt.graph_frame([], tokenizer, 0)
    with pytest.raises(ValueError, match=r"tokens\[1\] must be an integer in 0\.\.3, got 4"):
        igg.attribution_graphs(model, ids, 4, tokens=[0, 4])
    with pytest.raises(ValueError, match=r"tokens must be None or a non-empty sequence"):
        igg.attribution_graphs(model, ids, 4, tokens=[])
    other = ids.flip(1)
    graphs = [igg.attribution_graph(model, ids, 4, token=1), igg.attribution_graph(model, other, 4, token=1)]
    frame = igt.graph_frame(graphs, tokenizer, 2)
    assert frame["token"].tolist()[-1] == tokenizer.decode([int(other[0, 5])])  # each graph's own text
    assert frame["token"].tolist()[0] == tokenizer.decode([int(ids[0, 5])])


def test_top_parts_tie_rule():
    """Zero-tied parts are never picked; ties within rounding go to the lower index; the same picks
    as igs.top_positive of |share| (the project's rule, which iglens_data may not import)."""
    import iglens_stats as igs
    shares = torch.tensor([0.0, 3e-6, -0.2, 0.2 + 1e-7, 0.1, -4e-6, 0.05], dtype=torch.float64)
    assert igs.top_parts(shares, 3).tolist() == [2, 3, 4]
    assert igs.top_parts(shares, 10).tolist() == [2, 3, 4, 6]  # 0, 3e-6 and -4e-6 are tied with 0
    assert igs.top_parts(torch.zeros(2, 3), 2).tolist() == []
    assert igs.top_parts(-shares.flip(0), 2).tolist() == [3, 4]
    gen = np.random.default_rng(0)
    for trial in range(200):  # chains of near ties, exact ties, values near 0, grids
        size = int(gen.integers(1, 40))
        values = gen.choice([0.0, 1e-6, 0.01, 0.02, 0.5], size) * gen.choice([-1, 1], size)
        values = values + gen.normal(0, [1e-6, 1e-3, 0.1][trial % 3], size) * (gen.random(size) < 0.5)
        k = int(gen.integers(1, size + 3))
        want = igs.top_positive(np.abs(values), min(k, size))
        assert igs.top_parts(values.reshape(1, -1), k).tolist() == want.tolist(), (values, k)
        assert igs.top_parts(values, k).tolist() == _top_parts_by_full_sort(values, k).tolist(), (values, k)
    for trial in range(300):  # large vectors: the picks equal those of sorting every value
        size = int(gen.integers(50, 3000))
        scale = [1e-6, 1e-5, 3e-5, 1e-3][trial % 4]  # chains of near ties of every length
        values = np.cumsum(gen.exponential(scale, size)) * gen.choice([-1, 1], size)
        values = gen.permutation(np.concatenate([values, np.zeros(int(gen.integers(0, 50)))]))
        if trial % 5 == 0:
            values[gen.integers(0, len(values), 20)] = values[0]  # exact ties
        k = int(gen.integers(1, 60))
        assert igs.top_parts(values, k).tolist() == _top_parts_by_full_sort(values, k).tolist(), (trial, k)


def _top_parts_by_full_sort(values, k):
    """The tie rule by sorting every value and grouping in a plain loop: a group holds the values within
    the tolerance below its largest member (top_parts sorts only the values that can be picked)."""
    size = np.abs(np.asarray(values, dtype=np.float64)).reshape(-1)
    tolerance = ig.tie_tolerance(size)[0]
    order = np.argsort(-size, kind="stable")
    group, anchor = [], None
    for value in size[order]:
        if anchor is None or value < anchor - tolerance:
            anchor = value
            group.append(len(group) and group[-1] + 1)
        else:
            group.append(group[-1])
    top = order[np.lexsort((order, np.array(group)))][:k]
    return top[size[top] > tolerance]


def test_resume_refuses_other_resolution(tmp_path, tokenizer):
    model = tiny_model("llama", seed=8, vocab_size=VOCAB)
    facts, out = _facts(2), tmp_path / "r.parquet"
    run = lambda **more: igd.attribute_dataset(model, tokenizer, facts, out=out, resume=True, steps=2,
                                               progress=False, **{"resolution": "head", "top_k": 3, **more})
    results, _, parts = run()
    assert igt.parts_path(out) == tmp_path / "r.components.parquet"
    pd.testing.assert_frame_equal(pd.read_parquet(igt.parts_path(out)), parts)
    # a parts shard whose results shard was never written (killed between them) is dropped
    shard = next((tmp_path / "r.parquet.parts").glob("*.components.parquet"))
    pd.read_parquet(shard).assign(shard="rank0000-0").to_parquet(shard.with_name("rank0000-0.components.parquet"))
    again_results, _, again = run()  # the same settings: a no-op
    pd.testing.assert_frame_equal(again, parts)
    pd.testing.assert_frame_equal(again_results, results)
    for more, match in [(dict(resolution="source"), r"resolution: 'head' in the shards, 'source' now"),
                        (dict(top_k=4), r"top_k: 3 in the shards, 4 now"),
                        (dict(resolution=None), r"resolution: 'head' in the shards, None now"),
                        (dict(resolution="graph"), r"resolution: 'head' in the shards, 'graph' now")]:
        with pytest.raises(ValueError, match=r"resume: the shards in .* were made with other settings .*" + match):
            run(**more)
    igd.attribute_dataset(model, tokenizer, facts, out=out, steps=2, progress=False)  # a fresh plain run
    assert not igt.parts_path(out).exists()  # no stale parts table beside it


def test_bad_resolution_and_top_k(tokenizer, tmp_path, capsys):
    model = tiny_model("llama", vocab_size=VOCAB)
    facts = _facts(1)
    for top_k in (0, -2, 2.5, True, "3"):
        with pytest.raises(ValueError, match=rf"top_k must be an integer >= 1 \(parts written per answer token\), "
                                             rf"got {top_k!r}"):
            igd.attribute_dataset(model, tokenizer, facts, resolution="head", top_k=top_k)
    with pytest.raises(ValueError, match=r"resolution must be None or one of \('head', 'neuron', 'source', 'graph'\), "
                                         r"got 'block'"):
        igd.attribute_dataset(model, tokenizer, facts, resolution="block")
    with pytest.raises(ValueError, match=r"needs baseline='embedding', got 'zero'"):
        igd.attribute_dataset(model, tokenizer, facts, resolution="source", baseline="zero")
    csv = tmp_path / "items.csv"
    facts.to_csv(csv, index=False)
    base = ["--dataset", str(csv), "--out", str(tmp_path / "o.parquet")]
    for value, match in [("0", "argument --top-k: must be an integer >= 1, got 0"),
                         ("-3", "argument --top-k: must be an integer >= 1, got -3"),
                         ("2.5", "argument --top-k: expected an integer >= 1, got '2.5'")]:
        with pytest.raises(SystemExit):
            igcli.main([*base, "--resolution", "source", "--top-k", value])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        igcli.main([*base, "--top-k", "3"])
    assert "--top-k needs --resolution" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        igcli.main([*base, "--resolution", "sources"])
    assert "argument --resolution: invalid choice: 'sources'" in capsys.readouterr().err


def test_cli_on_the_packaged_model(tmp_path, tokenizer, packaged, capsys):
    """``iglens --dataset F --resolution source --top-k 3`` on the packaged model, 2 items."""
    facts = _facts(2)
    csv = tmp_path / "two.csv"
    facts.to_csv(csv, index=False)
    out = tmp_path / "two.parquet"
    assert igcli.main(["--dataset", str(csv), "--out", str(out), "--steps", "4", "--resolution", "source",
                       "--top-k", "3"]) == 0
    printed = capsys.readouterr().out
    assert "2 items done, 0 failed" in printed and f"in {tmp_path / 'two.components.parquet'}" in printed
    results, parts = pd.read_parquet(out), pd.read_parquet(igt.parts_path(out))
    assert (parts["kind"] == "source").sum() >= 3  # probabilities of a trained model: parts stand out
    model, _ = packaged
    for item in facts.itertuples():
        _check_item(model, tokenizer, item, parts[parts["id"] == item.id], results[results["id"] == item.id],
                    "source", 3, steps=4, estimator="prediction_aware")


def test_cli_views_name_the_quantity_and_show_the_sources(tmp_path, model_dir, capsys):
    """``--dataset --quantity logprob --resolution source --html DIR``: each item's view is titled in
    log-probability (not "probability", which Attribution.from_frame alone would say) and its
    source panel holds the parts table's per-source totals and rest."""
    from test_html import _embedded, _figure
    facts = _facts(2)
    csv, views, out = tmp_path / "items.csv", tmp_path / "views", tmp_path / "r.parquet"
    facts.to_csv(csv, index=False)
    views.mkdir()
    assert igcli.main(["--dataset", str(csv), "--out", str(out), "--model", str(model_dir), "--steps", "2",
                       "--quantity", "logprob", "--resolution", "source", "--top-k", "2", "--html", str(views)]) == 0
    assert "interactive views: 2 files" in capsys.readouterr().out
    parts = pd.read_parquet(igt.parts_path(out))
    for item in facts["id"]:
        text = (views / f"{item}.html").read_text(encoding="utf-8")
        _, layout = _figure(text)
        assert [a["text"] for a in layout["annotations"]][:1] == ["attribution (Δ log-probability (nats))"]
        data = _embedded(text, "iglens-sources-data")
        rows = parts[parts["id"] == item]
        assert data["blocks"] == ["all blocks"]
        for t, token_rows in rows.groupby("token_index"):
            totals = token_rows[token_rows["kind"] == "source_total"]
            got = np.array(data["by_source"][t])
            np.testing.assert_array_equal(got[:len(totals)], totals["share"].to_numpy())
            assert (got[len(totals):-1] == 0).all()
            assert got[-1] == token_rows[token_rows["kind"] == "source_rest"]["share"].iloc[0]
            np.testing.assert_array_equal(np.array(data["maps"][t][0]), got[:-1])
        assert data["source_tokens"][:3] == rows[rows["kind"] == "source_total"].drop_duplicates(
            "source_position")["source_token"].tolist()[:3]


def test_an_item_failing_in_components_is_an_error_row(tokenizer, monkeypatch):
    """components() refusing one item (e.g. an attention it cannot split) makes it an error row, with
    neither block rows nor parts left behind; the other items are written."""
    model = tiny_model("llama", seed=9, vocab_size=VOCAB)
    facts = _facts(3)
    bad = igd.encode(tokenizer, facts["prompt"][1], facts["answer"][1])[0]
    real = igd.collect_components

    def refuses_one(model, input_ids, prompt_len, **kwargs):
        if torch.equal(input_ids, bad):
            raise ValueError("this attention does not read its values as sources=True assumes")
        return real(model, input_ids, prompt_len, **kwargs)
    monkeypatch.setattr(igd, "collect_components", refuses_one)
    results, errors, parts = igd.attribute_dataset(model, tokenizer, facts, steps=2, batch_size=3,
                                                   progress=False, resolution="source", top_k=2)
    assert errors["id"].tolist() == [facts["id"][1]] and "sources=True assumes" in errors["error"][0]
    kept = [facts["id"][0], facts["id"][2]]
    assert sorted(results["id"].unique()) == sorted(kept) and sorted(parts["id"].unique()) == sorted(kept)
