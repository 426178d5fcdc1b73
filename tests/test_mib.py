"""MIB's circuit-localization protocol (issue 44, iglens_mib): the graph's size against MIB's, the
edge-patched forward against the model's own clean and counterfactual runs and against hand-written
forwards (one edge into the logits taken out; a two-edge circuit through one head's value), the
methods' conventions (EAP as the derivative of the logit difference in an edge's weight, the EAP-IG
variants at one step), MIB's selection, pruning, areas and JSON, the IOI templates, and bad input."""
import json

import numpy as np
import pytest
import torch

import iglens_core as ig
import iglens_mib as mib
from conftest import blocks, tiny_model

ARCHS = ["llama", "gpt2", "gemma3"]  # GQA; fused c_attn with biases; q/k norms, post-norms, soft-cap
ATOL = 2e-5


def pair(seed=0, batch=2, length=8, vocab=97):
    """``(clean, corrupted)`` (B, S) ids differing at two positions."""
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (batch, length), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 7) % vocab
    corrupted[:, -3] = (corrupted[:, -3] + 11) % vocab
    return clean, corrupted


def setup(arch, dtype=torch.float32):
    model = tiny_model(arch, seed=ARCHS.index(arch), dtype=dtype)
    return model, mib.MIBGraph.from_model(model), mib.model_layers(model)


# ---- hand-written pieces, from the model's own modules and hooks (independent of the harness) ----

def capture(model, ids):
    """The model's own run: last-position logits, the input of every block, the final norm's input,
    the output projection's input and output per block, the MLP's output (after Gemma's post-MLP
    norm) per block, and the attention probabilities (eager)."""
    store, handles = {"block_in": {}, "o_in": {}, "o_out": {}, "mlp": {}}, []
    for L, block in enumerate(blocks(model)):
        handles.append(block.register_forward_pre_hook(
            lambda m, a, k, L=L: store["block_in"].__setitem__(L, (a[0] if a else k["hidden_states"]).detach()),
            with_kwargs=True))
        attn = getattr(block, "self_attn", None) or block.attn
        o = getattr(attn, "o_proj", None) or attn.c_proj
        handles.append(o.register_forward_hook(
            lambda m, a, out, L=L: store["o_in"].__setitem__(L, a[0].detach()) or store["o_out"].__setitem__(L, out.detach())))
        mlp_out = getattr(block, "post_feedforward_layernorm", None) or block.mlp
        handles.append(mlp_out.register_forward_hook(lambda m, a, out, L=L: store["mlp"].__setitem__(L, out.detach())))
    final = model.base_model.norm if hasattr(model.base_model, "norm") else model.base_model.ln_f
    handles.append(final.register_forward_pre_hook(lambda m, a: store.__setitem__("final_in", a[0].detach())))
    try:
        with torch.no_grad():
            model.config._attn_implementation = "eager"
            out = model(input_ids=ids, use_cache=False, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    store["logits"], store["patterns"] = out.logits[:, -1], out.attentions
    return store


def head_out(model, L, h, o_in):
    """Head h's share of block L's output projection: (B, S, d), bias left out."""
    attn = getattr(blocks(model)[L], "self_attn", None) or blocks(model)[L].attn
    W, _ = ig.projection_weight(getattr(attn, "o_proj", None) or attn.c_proj)  # (d, H hd)
    H = ig.head_counts(model)[0]
    hd = W.shape[1] // H
    return o_in[..., h * hd:(h + 1) * hd] @ W[:, h * hd:(h + 1) * hd].T


def readout(model, x):
    """Last-position logits of the final-norm input ``x`` (B, S, d): norm, unembedding, soft-cap."""
    final = model.base_model.norm if hasattr(model.base_model, "norm") else model.base_model.ln_f
    logits = model.lm_head(final(x))[:, -1]
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def attn_into_resid(model, L, total):
    """Block L's attention output as the residual sees it (Gemma: its post-attention norm)."""
    block = blocks(model)[L]
    return block.post_attention_layernorm(total) if hasattr(block, "pre_feedforward_layernorm") else total


def value_head(model, L, h, x):
    """Head h's value vectors of block L from the residual ``x`` (B, S, d): input norm, v projection
    (GQA: its key/value head), (B, S, hd)."""
    block = blocks(model)[L]
    H, H_kv = ig.head_counts(model)
    attn = getattr(block, "self_attn", None) or block.attn
    norm = getattr(block, "input_layernorm", None) or block.ln_1
    if hasattr(attn, "v_proj"):
        W, b = ig.projection_weight(attn.v_proj)
        hd = W.shape[0] // H_kv
        k = h // (H // H_kv)
        v = norm(x) @ W[k * hd:(k + 1) * hd].T
        return v + (b[k * hd:(k + 1) * hd] if b is not None else 0)
    W, b = ig.projection_weight(attn.c_attn)
    d = W.shape[1]
    hd = d // H
    rows = slice(2 * d + h * hd, 2 * d + (h + 1) * hd)
    return norm(x) @ W[rows].T + b[rows]


# ---- the graph ----

def mib_edge_count(n_layers: int, n_heads: int) -> tuple[int, int]:
    """``(nodes, edges)`` of MIB's graph by formula: nodes 2 + L (H + 1); edges into block l's heads
    3 H (1 + l (H + 1)), into its MLP 1 + l (H + 1) + H, into the logits 1 + L (H + 1)."""
    edges = sum(3 * n_heads * (1 + l * (n_heads + 1)) + 1 + l * (n_heads + 1) + n_heads for l in range(n_layers))
    return 2 + n_layers * (n_heads + 1), edges + 1 + n_layers * (n_heads + 1)


def test_graph_counts_match_mib():
    assert mib_edge_count(12, 12) == (158, 32491)  # GPT-2 small, as MIB states
    graph = mib.MIBGraph(12, 12, 768)
    assert (len(graph.nodes), graph.n_edges, int(graph.real.sum())) == (158, 32491, 32491)
    assert len(set(graph.edges)) == graph.n_edges
    assert graph.edges[:4] == ["input->a0.h0<q>", "input->a0.h0<k>", "input->a0.h0<v>", "input->a0.h1<q>"]
    assert graph.edges[-1] == "m11->logits" and "a11.h3->m11" in graph.edge_index
    assert "a3.h0->a3.h1<q>" not in graph.edge_index  # heads of one block do not feed each other
    assert mib_edge_count(30, 9) == (302, 123211)  # SmolLM2-135M
    assert (graph.n_forward, graph.n_backward) == (157, 445)


def test_indices_follow_mib():
    graph = mib.MIBGraph(3, 4)
    assert graph.forward_index("a1.h2") == 1 + 1 * 5 + 2 and graph.forward_index("m2") == 1 + 2 * 5 + 4
    assert graph.backward_index("a1.h2", "k") == 1 * 13 + 4 + 2 and graph.backward_index("m0") == 12
    assert graph.backward_index("logits") == graph.n_backward - 1
    assert graph.receivers[graph.backward_index("a2.h3", "v")] == "a2.h3<v>"
    for name, s, r in zip(graph.edges, graph.edge_src.tolist(), graph.edge_dst.tolist()):
        assert s < graph.prev_index(r)
    assert int(graph.real.sum()) == sum(graph.prev_index(r) for r in range(graph.n_backward))


def test_scores_dict_round_trip_and_json(tmp_path):
    graph = mib.MIBGraph(2, 3, 16)
    scores = mib.random_scores(graph, seed=3)
    named = mib.edge_dict(graph, scores)
    assert list(named) == graph.edges
    assert torch.equal(mib.scores_from_dict(graph, named), scores)
    chosen = mib.top_edges(graph, scores, 10, absolute=True)
    path = mib.save_circuit(tmp_path / "c.json", graph, scores, chosen)
    d = json.loads(path.read_text())
    assert set(d) == {"cfg", "nodes", "edges"}
    assert d["cfg"] == {"n_layers": 2, "n_heads": 3, "parallel_attn_mlp": False, "d_model": 16}
    assert set(d["edges"]["input->logits"]) == {"score", "in_graph"} and d["nodes"]["logits"]["in_graph"]
    kept, _ = mib.prune(graph, chosen)
    assert sum(e["in_graph"] for e in d["edges"].values()) == int(kept.sum())


def test_top_edges_signed_and_absolute():
    graph = mib.MIBGraph(1, 2)
    scores = torch.zeros(graph.n_forward, graph.n_backward)
    s, r = graph.edge_src, graph.edge_dst
    scores[s, r] = torch.linspace(-1, 0.5, graph.n_edges)  # the most negative first
    signed = mib.top_edges(graph, scores, 3, absolute=False)
    absolute = mib.top_edges(graph, scores, 3, absolute=True)
    assert signed[s[-3:], r[-3:]].all() and absolute[s[:3], r[:3]].all()
    assert int(signed.sum()) == int(absolute.sum()) == 3


def test_prune_removes_dangling():
    graph = mib.MIBGraph(2, 2)
    edges = torch.zeros(graph.n_forward, graph.n_backward, dtype=torch.bool)
    a = graph.forward_index("a1.h0")
    edges[a, graph.backward_index("logits")] = True  # a head with no input: gone
    edges[0, graph.backward_index("m0")] = True  # an MLP with no output: gone
    edges[0, graph.backward_index("a0.h1", "q")] = True
    edges[graph.forward_index("a0.h1"), graph.n_backward - 1] = True  # input -> a0.h1<q> -> logits: kept
    kept, nodes = mib.prune(graph, edges)
    assert int(kept.sum()) == 2 and nodes[graph.forward_index("a0.h1")] and not nodes[a]


def test_areas_trapezoids():
    under, from_1 = mib.areas([0.0, 0.5, 1.0], [0.0, 1.0, 1.0])
    assert under == pytest.approx(0.75) and from_1 == pytest.approx(0.25)


# ---- the edge-patched forward ----

@pytest.mark.parametrize("arch", ARCHS + ["qwen2"])
def test_all_edges_clean_no_edges_counterfactual(arch):
    model = tiny_model(arch, seed=5)  # Qwen2: q, k, v biases
    graph, layers = mib.MIBGraph.from_model(model), mib.model_layers(model)
    clean, corrupted = pair()
    own_clean, own_corr = capture(model, clean)["logits"], capture(model, corrupted)["logits"]
    acts, _ = mib.record_acts(model, graph, layers, corrupted)
    full = mib.patched_logits(model, graph, layers, clean, graph.real.float(), acts)
    empty = mib.patched_logits(model, graph, layers, clean, torch.zeros(graph.n_forward, graph.n_backward), acts)
    assert (own_clean - own_corr).abs().max() > 1e-3
    assert (full - own_clean).abs().max() < ATOL and (empty - own_corr).abs().max() < ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_one_edge_into_logits_out_by_hand(arch):
    model, graph, layers = setup(arch)
    clean, corrupted = pair(1)
    c, k = capture(model, clean), capture(model, corrupted)
    acts, _ = mib.record_acts(model, graph, layers, corrupted)
    n, logits = graph.n_layers - 1, graph.backward_index("logits")
    hand = {
        "input": c["final_in"] - c["block_in"][0] + k["block_in"][0],
        f"m{n}": c["final_in"] - c["mlp"][n] + k["mlp"][n],
        f"a{n}.h1": c["final_in"] - attn_into_resid(model, n, c["o_out"][n])
        + attn_into_resid(model, n, c["o_out"][n] - head_out(model, n, 1, c["o_in"][n]) + head_out(model, n, 1, k["o_in"][n])),
    }
    for sender, x in hand.items():
        weights = graph.real.float()
        weights[graph.forward_index(sender), logits] = 0
        got = mib.patched_logits(model, graph, layers, clean, weights, acts)
        with torch.no_grad():
            want = readout(model, x)
        assert (got - want).abs().max() < ATOL, sender
        if sender != "input":  # the last token is the same in both runs
            assert (want - c["logits"]).abs().max() > 1e-4, sender  # the edge matters


@pytest.mark.parametrize("arch", ARCHS)
def test_value_path_circuit_by_hand(arch):
    """Circuit {input -> a{n}.h{h}<v>, a{n}.h{h} -> logits}: the head reads the clean embedding through
    its values only (its pattern and every other input stay counterfactual)."""
    model, graph, layers = setup(arch)
    clean, corrupted = pair(2)
    c, k = capture(model, clean), capture(model, corrupted)
    acts, _ = mib.record_acts(model, graph, layers, corrupted)
    n, h = graph.n_layers - 1, 2
    weights = torch.zeros(graph.n_forward, graph.n_backward)
    weights[0, graph.backward_index(f"a{n}.h{h}", "v")] = 1
    weights[graph.forward_index(f"a{n}.h{h}"), graph.backward_index("logits")] = 1
    got = mib.patched_logits(model, graph, layers, clean, weights, acts)
    with torch.no_grad():
        x_v = k["block_in"][n] - k["block_in"][0] + c["block_in"][0]
        z = k["patterns"][n][:, h] @ value_head(model, n, h, x_v)  # (B, S, hd)
        H = graph.n_heads
        o_in = k["o_in"][n].clone()
        hd = o_in.shape[-1] // H
        o_in[..., h * hd:(h + 1) * hd] = z
        new, old = head_out(model, n, h, o_in), head_out(model, n, h, k["o_in"][n])
        x = k["final_in"] - attn_into_resid(model, n, k["o_out"][n]) + attn_into_resid(model, n, k["o_out"][n] - old + new)
        want = readout(model, x)
    assert (want - k["logits"]).abs().max() > 1e-4
    assert (got - want).abs().max() < ATOL


# ---- methods ----

def labels_for(clean):
    return torch.stack([clean[:, -2], clean[:, 1]], 1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eap_is_the_edge_weight_derivative(arch):
    """Without post-norms, d m / d w(edge) of the patched forward at the full circuit (autograd through
    the circuit's weights, float64) is (clean - corrupted sender) . grad at the receiver: EAP's score."""
    model, graph, layers = setup(arch, torch.float64)
    clean, corrupted = pair(3)
    labels = labels_for(clean)
    scores = mib.eap_scores(model, graph, layers, clean, corrupted, labels)
    acts, _ = mib.record_acts(model, graph, layers, corrupted)
    weights = graph.real.double().requires_grad_(True)
    with torch.enable_grad():
        mixer = mib._Mixer(graph, layers, weights, acts)
        metric = mib.logit_diff(mib._run(model, graph, layers, clean, mixer), labels).sum()
        (grad,) = torch.autograd.grad(metric, weights)
    grad = grad * graph.real
    assert grad.abs().max() > 1e-3
    assert torch.allclose(scores.double(), grad, rtol=1e-5, atol=1e-7 * float(grad.abs().max()))


def test_ig_variants_at_one_step():
    """EAP-IG on activations at one step (alpha = 1: every run has the clean run's values, but the node set
    is a constant, which cuts the gradient through it, as MIB's hook does) is EAP on the edges into the
    logits; EAP-IG on inputs at one step (alpha = 0) is EAP's product with the gradient of the
    counterfactual run."""
    model, graph, layers = setup("llama", torch.float64)
    clean, corrupted = pair(4)
    labels = labels_for(clean)
    eap = mib.eap_scores(model, graph, layers, clean, corrupted, labels)
    acts = mib.eap_ig_activations_scores(model, graph, layers, clean, corrupted, labels, steps=1, chunk=3)
    assert torch.allclose(acts[:, -1], eap[:, -1], rtol=1e-6, atol=1e-9)
    assert not torch.allclose(acts, eap, rtol=1e-3)
    inputs = mib.eap_ig_inputs_scores(model, graph, layers, clean, corrupted, labels, steps=1)
    diff = mib.record_acts(model, graph, layers, clean)[0].flat() - mib.record_acts(model, graph, layers, corrupted)[0].flat()
    at_corrupted = mib.contract(graph, diff, mib._gradients(model, graph, layers, corrupted, labels))
    assert torch.allclose(inputs, at_corrupted, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(inputs, eap, rtol=1e-3)
    more = mib.eap_ig_inputs_scores(model, graph, layers, clean, corrupted, labels, steps=3)
    assert torch.isfinite(more).all() and (more * ~graph.real).abs().max() == 0


@pytest.mark.parametrize("arch", ["gemma3"])
def test_methods_run_on_post_norm_models(arch):
    model, graph, layers = setup(arch)
    clean, corrupted = pair(5)
    labels = labels_for(clean)
    for scores in (mib.eap_scores(model, graph, layers, clean, corrupted, labels),
                   mib.eap_ig_activations_scores(model, graph, layers, clean, corrupted, labels, steps=2)):
        assert torch.isfinite(scores).all() and scores[graph.real].abs().max() > 0


# ---- the protocol on templated IOI ----

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ig.resolve_model_path("smollm2-135m-instruct"), local_files_only=True)


def test_ioi_items(tokenizer):
    items = mib.ioi_items(tokenizer, 12, seed=1)
    again = mib.ioi_items(tokenizer, 12, seed=1)  # seeded
    assert [(i.clean, i.corrupted) for i in items] == [(i.clean, i.corrupted) for i in again]
    assert [i.order for i in items[:2]] == ["ABBA", "BABA"]
    for item in items:
        assert len(item.clean_ids) == len(item.corrupted_ids)
        assert item.clean.count(item.foil) == 2 and item.corrupted.count(item.answer) == 2  # s2_io_flip
        assert item.clean.startswith(item.corrupted[:item.corrupted.rindex(item.answer)].rsplit(" ", 1)[0])
        assert (item.clean_ids != item.corrupted_ids).sum() == 1
        assert tokenizer.decode([item.answer_id]) == item.answer and tokenizer.decode([item.foil_id]) == item.foil
    first = items[0].clean.split(",")[0]
    assert items[0].answer.strip() in items[0].clean.split(" and ")[0] or items[0].answer.strip() in first


def test_protocol_end_to_end(tokenizer):
    """keep_solved, the Evaluation's end points, and CPR / CMD of two methods on a tiny model with the
    SmolLM2 vocabulary."""
    model = tiny_model("llama", seed=3, vocab_size=tokenizer.vocab_size + len(tokenizer.get_added_vocab()))
    items = mib.ioi_items(tokenizer, 4, seed=0)
    kept, report = mib.keep_solved(model, items, quiet=True)
    assert report["solved"] == len(kept) == int((report["logit_diffs"] > 0).sum()) and report["total"] == 4
    ev = mib.Evaluation(model, items, batch_size=4)
    assert np.allclose(ev.m_empty, mib.logit_diffs(model, items, corrupted=True), atol=ATOL)
    assert ev.faithfulness(ev.graph.real) == pytest.approx(1, abs=1e-4)
    eap = mib.edge_scores(model, items, "EAP")
    result = mib.cpr_cmd(ev, eap.scores, percentages=(0.01, 0.1, 1.0))
    assert result["signed"]["faithfulness"][-1] == pytest.approx(1, abs=1e-4)
    assert result["absolute"]["n_edges"][-1] == ev.graph.n_edges and result["CMD"] >= 0
    assert mib.edge_scores(model, items, "random").scores.shape == eap.scores.shape and eap.seconds_per_item > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_gemm_mixer_equals_the_blend(arch):
    """Without a post-attention norm the patched forward mixes with one GEMM over the senders' differences;
    with weights that need gradients it takes the per-block blend: the two agree on a fractional circuit."""
    model, graph, layers = setup(arch)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # GPT-2's biases start at 0: give them values, so that the output bias counts
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    layers = mib.model_layers(model)
    clean, corrupted = pair(seed=4)
    acts, _ = mib.record_acts(model, graph, layers, corrupted)
    weights = (torch.rand(graph.n_forward, graph.n_backward, generator=gen) * graph.real).double()
    weights[:, :graph.n_backward // 2] *= torch.rand(graph.n_forward, 1, generator=gen).double() < 0.1  # sparse rows
    fast = mib.patched_logits(model, graph, layers, clean, weights, acts)
    slow = mib.patched_logits(model, graph, layers, clean, weights.clone().requires_grad_(True), acts)
    assert torch.allclose(fast, slow, atol=ATOL) and not torch.allclose(fast, mib.record_acts(model, graph, layers, clean)[1])


# ---- a long run in records (notebook 12) ----

def test_run_in_records_matches_one_pass(tokenizer, tmp_path):
    """Score sums per length group, recorded and read back, give the mean scores of one pass over all items;
    a shard takes every k-th group; the circuits of a curve are nested and end in the whole graph; a group's
    metric table holds the plain clean and counterfactual runs and the harness's circuit metric."""
    import iglens_tables as igt
    model = tiny_model("llama", seed=5, vocab_size=tokenizer.vocab_size + len(tokenizer.get_added_vocab()))
    items = mib.ioi_items(tokenizer, 6, seed=2)
    groups = {f"g{k}": rows for k, rows in enumerate(mib.length_batches(items, 2))}
    assert sorted(i for rows in groups.values() for i in rows) == list(range(6)) and len(groups) >= 3
    store = igt.ItemRecords(tmp_path / "rec", {"test": 1}, model=model)
    methods = ["EAP", "EAP-IG-inputs", "random"]
    compute = lambda key: mib.score_table(model, [items[i] for i in groups[key]], methods, batch_size=1)
    tables = igt.recorded(list(groups), compute, store)
    assert set(tables["g0"]["scores"].columns) == {"EAP", "EAP-IG-inputs"}  # random needs no items

    def boom(key):
        raise AssertionError("recomputed a stored group")
    again = igt.recorded(list(groups), boom, store)  # every group read back
    assert list(again) == list(groups)
    assert list(igt.recorded(list(groups), boom, store, shard="1/2")) == list(groups)[1::2]
    graph = mib.MIBGraph.from_model(model)
    for method in ("EAP", "EAP-IG-inputs"):
        total = sum(t["scores"][method].to_numpy(np.float64) for t in again.values()) / 6
        mean = mib.scores_from_dict(graph, dict(zip(graph.edges, total)))
        whole = mib.edge_scores(model, items, method, batch_size=6).scores
        assert torch.allclose(mean, whole, rtol=1e-4, atol=1e-6 * float(whole.abs().max()))
    assert sum(int(t["seconds"]["items"].iloc[0]) for t in again.values()) == 6

    circuits = mib.curve_circuits(graph, {"EAP": mean, "random": mib.random_scores(graph)}, percentages=(0.01, 0.1, 0.5, 1.0))
    assert len(circuits) == 2 * 2 * 4 and torch.equal(circuits["EAP/signed/1.0"], graph.real)
    for method in ("EAP", "random"):
        for kind in ("signed", "absolute"):
            chain = [circuits[f"{method}/{kind}/{p!r}"] for p in (0.01, 0.1, 0.5, 1.0)]
            assert all(bool((a <= b).all()) for a, b in zip(chain, chain[1:]))  # nested, after pruning too
            assert int(chain[1].sum()) <= int(0.1 * graph.n_edges)
    rows = max(groups.values(), key=len)
    group = [items[i] for i in rows]
    chosen = {"a": circuits["EAP/absolute/0.1"], "b": circuits["EAP/absolute/0.1"].clone(), "c": circuits["random/signed/0.5"]}
    table = mib.metric_table(model, group, chosen)
    assert list(table.columns) == ["full", "empty", "corrupted", "a", "b", "c"] and len(table) == len(group)
    assert np.array_equal(table["full"], mib.logit_diffs(model, group))
    assert np.array_equal(table["corrupted"], mib.logit_diffs(model, group, corrupted=True))
    assert np.allclose(table["empty"], table["corrupted"], atol=ATOL) and np.array_equal(table.a, table.b)
    ev = mib.Evaluation(model, items, batch_size=6)  # all items, other batches
    for name in "ac":
        assert np.allclose(table[name], ev.circuit_metric(chosen[name])[rows], atol=ATOL)


def test_bootstrap_areas_against_a_direct_computation():
    import iglens_stats as igs
    rng = np.random.default_rng(4)
    x, N, n_boot = (0.001, 0.01, 0.1, 0.5, 1.0), 7, 5
    full, empty = rng.normal(3, 1, N), rng.normal(-1, 1, N)
    curves = {"a": rng.normal(1, 2, (len(x), N)), "same": None, "model": np.tile(full, (len(x), 1))}
    curves["same"] = curves["a"].copy()
    out = igs.bootstrap_areas(curves, full, empty, x, n_boot=n_boot, seed=9)
    draws = np.random.default_rng(9).integers(0, N, size=(n_boot, N))
    for j, rows in enumerate([list(range(N))] + [list(r) for r in draws]):
        f = [(sum(curves["a"][k][i] for i in rows) / N - sum(empty[i] for i in rows) / N)
             / (sum(full[i] for i in rows) / N - sum(empty[i] for i in rows) / N) for k in range(len(x))]
        assert out["a"][j] == pytest.approx(mib.areas(x, f), rel=1e-12)
    assert np.array_equal(out["a"], out["same"])  # the same resamples for every key: differences are paired
    assert np.allclose(out["model"], [[x[-1] - x[0], 0.0]] * (n_boot + 1))  # f = 1 everywhere
    under, from_1 = igs.curve_areas(x, np.stack([np.zeros(5), np.ones(5)]))
    assert np.allclose(under, [0, 0.999]) and np.allclose(from_1, [0.999, 0])
    assert igs.interval_text(np.array([0.5, 0.1, 0.2, 0.9]), digits=2, level=0.5) == \
        f"0.50 [{np.quantile([0.1, 0.2, 0.9], 0.25):.2f}, {np.quantile([0.1, 0.2, 0.9], 0.75):.2f}]"
    assert igs.interval_text(np.array([-0.5, 1.0]), signed=True, digits=1) == "-0.5 [+1.0, +1.0]"
    with pytest.raises(ValueError, match=r"curve 'a' must be \(5, 7\)"):
        igs.bootstrap_areas({"a": np.zeros((4, 7))}, full, empty, x)
    with pytest.raises(ValueError, match="m_full and m_empty must be"):
        igs.bootstrap_areas({}, full, empty[:3], x)


def test_plot_faithfulness():
    import matplotlib
    matplotlib.use("Agg")
    import iglens_plot as igp
    p = (0.001, 0.01, 1.0)
    fig = igp.plot_faithfulness({"signed": {"EAP": [0.1, 0.5, 1.0], "random": [0, 0.1, 1.0]},
                                 "absolute": {"EAP": [0.2, 0.6, 1.0], "random": [0, 0, 1.0]}}, p, title="t",
                                panels={"signed": "CPR's"})
    left, right = fig.axes
    assert left.get_xscale() == "log" and left.get_title() == "CPR's" and right.get_title() == "absolute"
    drawn = [line for line in left.lines if line.get_label() in ("EAP", "random")]
    assert [line.get_label() for line in drawn] == ["EAP", "random"]
    assert np.allclose(drawn[0].get_xdata(), [0.1, 1, 100]) and np.allclose(drawn[0].get_ydata(), [0.1, 0.5, 1.0])
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["EAP", "random"]


# ---- bad input ----

def test_bad_input():
    graph = mib.MIBGraph(2, 2)
    with pytest.raises(ValueError, match="n_heads must be an integer >= 1"):
        mib.MIBGraph(2, 0)
    with pytest.raises(ValueError, match=r"n must be an integer in 0\.\.%d" % graph.n_edges):
        mib.top_edges(graph, torch.zeros(graph.n_forward, graph.n_backward), graph.n_edges + 1, absolute=True)
    with pytest.raises(ValueError, match=r"scores must be \(7, 15\)"):
        mib.edge_dict(graph, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="outside the graph: layers 0..1"):
        graph.forward_index("a5.h0")
    with pytest.raises(ValueError, match="qkv in 'q', 'k', 'v'"):
        graph.backward_index("a0.h0")
    with pytest.raises(ValueError, match="method must be one of"):
        mib.edge_scores(None, [], "ACDC")
    with pytest.raises(ValueError, match="1 missing"):
        named = mib.edge_dict(graph, torch.zeros(graph.n_forward, graph.n_backward))
        named.pop("input->logits")
        mib.scores_from_dict(graph, named)
    with pytest.raises(ValueError, match="not supported"):
        mib.model_layers(tiny_model("neox"))


def test_save_circuit_gzip_round_trip(tmp_path):
    """A ``.gz`` path holds the same JSON as a plain one, compressed (the committed circuit file's form)."""
    import gzip
    import json
    graph = mib.MIBGraph(2, 2)
    scores = torch.arange(graph.n_forward * graph.n_backward, dtype=torch.float32).reshape(graph.n_forward, graph.n_backward)
    plain = mib.save_circuit(tmp_path / "c.json", graph, scores)
    packed = mib.save_circuit(tmp_path / "c.json.gz", graph, scores)
    assert json.loads(gzip.decompress(packed.read_bytes())) == json.loads(plain.read_text()) == mib.circuit_json(graph, scores)
