"""The graph's view and file (issue 32): the pruned graph's nodes and direct links against the Graph
object, circuit-tracer's schema, the page's numbers, the command line, bad input."""
import json
import math
import re

import numpy as np
import pytest
import torch

import iglens_cli as igcli
import iglens_core as ig
import iglens_graph as igg
import iglens_view as igv
from conftest import sharp_model
from test_html import _stub_cli

LENGTH, PROMPT = 10, 5


def model_of(arch, seed=0):
    """A sharpened tiny model (randomised norms) whose projection biases are random too (GPT-2: the
    constants node)."""
    model = sharp_model(arch, seed=seed)
    gen = torch.Generator().manual_seed(50 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and "norm" not in name and ".ln_" not in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model


def ids_of(seed, vocab=97):
    return torch.randint(0, vocab, (1, LENGTH), generator=torch.Generator().manual_seed(seed))


def share_in(graph, node) -> float:
    """A node's share read off the Graph object's own fields."""
    if node.kind == "head":
        return float(graph.heads[node.block - 1, node.index, node.position])
    if node.kind == "neuron":
        return float(graph.neurons[node.block - 1, node.position, node.index])
    if node.kind == "embedding":
        return float(graph.embeddings[node.position])
    return graph.delta


@pytest.fixture(scope="module")
def views():
    """Two answer tokens of a tiny GPT-2 (biases: constants) and one of a tiny Gemma 3, with their
    graphs built independently of the view (edges, float32 as the model)."""
    out = []
    for arch, seed, tokens in (("gpt2", 1, (1, 3)), ("gemma3", 2, (2,))):
        model, ids = model_of(arch, seed), ids_of(seed)
        texts = [f"w{i}<&>" for i in ids[0].tolist()]
        for token in tokens:
            view = igv.graph_view(model, ids, PROMPT, texts, token=token, fraction=0.6, min_share=0.01, steps=4)
            graph = igg.attribution_graph(model, ids, PROMPT, token=token, steps=4)
            out.append((arch, model, ids, token, view, graph))
    return out


def test_nodes_follow_the_rule_and_links_add_up(views):
    """Kept heads and neurons are the pruned ones above min_share; every embedding up to t and the
    logit follow; each node's share is the Graph's; the links into each node plus the constants add
    up to its share, those into the logit to delta, and nothing links from a later block."""
    for arch, model, ids, token, view, graph in views:
        t = graph.position
        kinds = [node.kind for node in view.nodes]
        want = [(node.kind, node.block, node.position, node.index) for node in graph.pruned(0.6)
                if node.kind != "embedding" and abs(node.share) >= 0.01 * abs(graph.delta)]
        assert [tuple(node[:4]) for node in view.nodes if node.kind in ("head", "neuron")] == want
        assert [node.position for node in view.nodes if node.kind == "embedding"] == list(range(t + 1))
        assert kinds[-1] == "logit" and kinds.count("logit") == 1 and len(want) > 3
        shares = torch.tensor([share_in(graph, node) for node in view.nodes], dtype=torch.float64)
        assert torch.allclose(torch.tensor([node.share for node in view.nodes], dtype=torch.float64), shares, rtol=0, atol=1e-6), arch
        incoming = view.links.sum(0) + view.constants
        chosen = [k for k, kind in enumerate(kinds) if kind != "embedding"]
        scale = float(shares.abs().max())
        assert torch.allclose(incoming[chosen], shares[chosen], rtol=0, atol=1e-5 * scale), arch
        assert float(incoming[-1]) == pytest.approx(graph.delta, abs=1e-5 * scale)
        blocks = torch.tensor([node.block for node in view.nodes])
        assert view.links[blocks[:, None] > blocks[None, :]].abs().max() == 0
        assert view.completeness()["gap"] < 1e-5 * scale
        assert (arch == "gpt2") == bool(view.constants.abs().max() > 0)


def test_activations_are_the_models(views):
    """A neuron's activation is its down projection's input and a head's the norm of its slice of the
    output projection's input, as the core's collector records them at the predicting positions; the
    probability is the model's own."""
    for arch, model, ids, token, view, graph in views:
        trace = ig.collect_components(model, ids, PROMPT)
        H = model.config.num_attention_heads
        answers = {int(p): k for k, p in enumerate(trace.positions)}
        checked = 0
        for node, value in zip(view.nodes, view.activations.tolist()):
            if node.kind in ("embedding", "logit"):
                assert math.isnan(value)
            elif node.position in answers:
                row = answers[node.position]
                if node.kind == "neuron":
                    want = float(trace.neurons[node.block - 1, row, node.index])
                else:
                    want = float(trace.heads[node.block - 1, row].view(H, -1)[node.index].norm())
                assert value == pytest.approx(want, rel=1e-5, abs=1e-6), node
                checked += 1
        assert checked > 0
        assert view.probability == pytest.approx(float(trace.model_probs[token]), abs=1e-6)
        assert view.label == f"w{int(ids[0, PROMPT + token])}<&>"


def test_circuit_tracer_file(views, tmp_path):
    """The file validates with circuit-tracer's own pydantic model; no error nodes; neurons and heads
    say what they are; the links out of the logit (into it, in circuit-tracer's direction) add up to
    the graph's share, delta, recomputed from the Graph object; every node's incoming links to its share."""
    from circuit_tracer.frontend.graph_models import Model
    for arch, model, ids, token, view, graph in views:
        path = igv.to_circuit_tracer(view, tmp_path / f"{arch}-{token}.json", scan="tiny")
        data = json.loads(path.read_text(encoding="utf-8"))
        parsed = Model.model_validate(data)
        ids_seen = [node.node_id for node in parsed.nodes]
        assert len(set(ids_seen)) == len(ids_seen)
        assert {link["source"] for link in data["links"]} | {link["target"] for link in data["links"]} <= set(ids_seen)
        types = {node.feature_type for node in parsed.nodes}
        assert not any("error" in kind for kind in types)
        assert types <= {"mlp neuron", "attention head", "embedding", "logit", "constants (biases)"}
        assert {"mlp neuron", "embedding", "logit"} <= types and ("constants (biases)" in types) == (arch == "gpt2")
        logits = [node for node in parsed.nodes if node.feature_type == "logit"]
        assert len(logits) == 1 and logits[0].is_target_logit and logits[0].ctx_idx == graph.position
        assert logits[0].feature == graph.target and logits[0].token_prob == pytest.approx(view.probability)
        assert parsed.metadata.prompt_tokens == [f"w{i}<&>" for i in ids[0, :graph.position + 1].tolist()]
        assert parsed.metadata.scan == "tiny" and parsed.metadata.slug == f"{arch}-{token}"
        into = sum(link["weight"] for link in data["links"] if link["target"] == logits[0].node_id)
        scale = float(graph.carried.abs().max())
        assert into == pytest.approx(graph.delta, abs=1e-5 * scale)
        H, d_ff = graph.heads.shape[1], graph.neurons.shape[-1]
        for node in parsed.nodes:
            if node.feature_type in ("mlp neuron", "attention head"):
                assert node.activation is not None and node.influence is not None
                block, index = int(node.layer) + 1, int(node.node_id.split("_")[1].lstrip("h"))
                share = (graph.neurons[block - 1, node.ctx_idx, index] if node.feature_type == "mlp neuron"
                         else graph.heads[block - 1, index, node.ctx_idx])
                incoming = sum(link["weight"] for link in data["links"] if link["target"] == node.node_id)
                assert incoming == pytest.approx(float(share), abs=1e-5 * scale), node.node_id
                assert index < (d_ff if node.feature_type == "mlp neuron" else H)
            assert node.influence is not None and 0 <= node.influence <= 1 + 1e-12
        assert data["metadata"]["iglens"]["delta"] == graph.delta


def _figure(text: str, div: str):
    found = re.search(rf'Plotly\.newPlot\(\s*"{div}",\s*', text)
    assert found, f"no Plotly.newPlot call for {div}"
    decoder = json.JSONDecoder()
    data, end = decoder.raw_decode(text, found.end())
    layout, _ = decoder.raw_decode(text[end:].lstrip().lstrip(",").lstrip())
    return data, layout


def _embedded(text: str):
    found = re.search(r'<script type="application/json" id="iglens-graph-data">(.*?)</script>', text, flags=re.S)
    assert found, "no iglens-graph-data script"
    return json.loads(found.group(1))


def test_page_holds_the_graph(views, tmp_path):
    """The page of two answer tokens: its embedded numbers and its drawn traces are the Graph's (node
    shares, carried map, links into the logit adding up to delta); the menu shows one token's traces at
    a time with its completeness line; nothing is loaded from elsewhere."""
    picked = [entry for entry in views if entry[0] == "gpt2"]
    path = igv.to_graph_html([entry[4] for entry in picked], tmp_path / "graph.html", title="tiny <b>")
    text = path.read_text(encoding="utf-8")
    payload = _embedded(text)["views"]
    data, layout = _figure(text, "iglens-graph")
    nodes_traces = [trace for trace in data if trace.get("name") == "nodes"]
    heat = [trace for trace in data if trace["type"] == "heatmap"]
    assert len(payload) == len(nodes_traces) == len(heat) == 2
    for (arch, model, ids, token, view, graph), entry, trace, carried in zip(picked, payload, nodes_traces, heat):
        t = graph.position
        assert entry["position"] == t and entry["target"] == graph.target and entry["label"] == view.label
        shares = [share_in(graph, igg.Node(n["kind"], n["block"], n["position"], n["index"], 0.0))
                  for n in entry["nodes"]]
        np.testing.assert_allclose([n["share"] for n in entry["nodes"]], shares, rtol=0, atol=1e-6)
        np.testing.assert_allclose([cell[4] for cell in trace["customdata"]], shares, rtol=0, atol=1e-6)
        assert [cell[0] for cell in trace["customdata"]] == [n["kind"] for n in entry["nodes"]]
        np.testing.assert_array_equal(np.array(carried["z"]), graph.carried[:, :t + 1].numpy())
        np.testing.assert_array_equal(np.array(entry["carried"]), graph.carried[:, :t + 1].numpy())
        logit = len(entry["nodes"]) - 1
        into = sum(w for i, j, w in entry["links"] if j == logit) + entry["link_constants"][logit]
        assert into == pytest.approx(graph.delta, abs=1e-5 * float(graph.carried.abs().max()))
        assert entry["tokens"] == [f"w{i}<&>" for i in ids[0, :t + 1].tolist()]
    buttons = layout["updatemenus"][0]["buttons"]
    assert len(buttons) == 2
    for k, button in enumerate(buttons):
        visible = button["args"][0]["visible"]
        shown = {trace.get("name") for trace, seen in zip(data, visible) if seen}
        assert {"nodes", "carried", "links"} <= shown
        assert [trace is nodes_traces[k] for trace, seen in zip(data, visible) if seen and trace.get("name") == "nodes"] == [True]
        delta = picked[k][5].delta_p
        assert f"Δp = {delta:+.4f}" in button["args"][1]["title.text"]
    assert [trace["visible"] for trace in data] == buttons[0]["args"][0]["visible"]
    assert "&lt;b&gt;" not in layout["title"]["text"] and "links into the logit" in layout["title"]["text"]
    tags = re.sub(r"(<script[^>]*>).*?</script>", r"\1", text, flags=re.S)
    assert re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", tags, flags=re.I) == []
    assert re.findall(r"<script[^>]*\ssrc\s*=", text, flags=re.I) == [] and "plotly.js v" in text


def test_bad_input(views, tmp_path):
    arch, model, ids, token, view, graph = views[0]
    texts = [str(i) for i in range(LENGTH)]
    for name, value, shown in (("fraction", 0, r"\(0\.0, 1\.0\], got 0"), ("fraction", 1.5, r"\(0\.0, 1\.0\], got 1\.5"),
                               ("min_share", -0.1, r"\[0\.0, 1\.0\], got -0\.1"),
                               ("min_share", "x", r"\[0\.0, 1\.0\], got 'x'")):
        with pytest.raises(ValueError, match=rf"{name} must be a number in {shown}"):
            igv.graph_view(model, ids, PROMPT, texts, **{name: value})
    with pytest.raises(ValueError, match=r"tokens must give the text of each of the S = 10 positions, got 9"):
        igv.graph_view(model, ids, PROMPT, texts[:9])
    with pytest.raises(ValueError, match="token must be an integer in 0..4, got 5"):
        igv.graph_view(model, ids, PROMPT, texts, token=5)
    with pytest.raises(ValueError, match="graph is answer token 1 of another sequence, not token 2"):
        igv.graph_view(model, ids, PROMPT, texts, token=2, graph=view.graph)
    with pytest.raises(ValueError, match="views must be a non-empty list of GraphView"):
        igv.to_graph_html([], tmp_path / "g.html")
    with pytest.raises(ValueError, match=r"path must name an \.html file"):
        igv.to_graph_html([view], tmp_path / "g.png")
    with pytest.raises(ValueError, match=r"min_link must be a number in \[0\.0, 1\.0\], got 2"):
        igv.to_graph_html([view], tmp_path / "g.html", min_link=2)
    with pytest.raises(ValueError, match=r"path must name a \.json file, got '.*g\.txt'"):
        igv.to_circuit_tracer(view, tmp_path / "g.txt")
    with pytest.raises(ValueError, match="folder .*missing.* does not exist"):
        igv.to_circuit_tracer(view, tmp_path / "missing" / "g.json")
    with pytest.raises(ValueError, match="give html_path, json_path or both"):
        igv.write_graph(model, ids, PROMPT, texts)
    for tokens in ([5], [1, 1], [], [True]):
        with pytest.raises(ValueError, match=rf"answer_tokens must be distinct integers in 0\.\.4, got {re.escape(repr(tokens))}"):
            igv.write_graph(model, ids, PROMPT, texts, answer_tokens=tokens, json_path=tmp_path / "g.json")
    assert not list(tmp_path.iterdir())


def test_cli_graph(tmp_path, monkeypatch, capsys):
    """``iglens graph PROMPT --html --json --tokens``: the page holds both tokens, one file per token
    whose links into the logit add up to the graph of that token built here; errors are one line."""
    model, ids = _stub_cli(monkeypatch, seed=4)
    page, file = tmp_path / "g.html", tmp_path / "g.json"
    assert igcli.main(["graph", "a prompt", "--html", str(page), "--json", str(file), "--tokens", "0,2",
                       "--steps", "3", "--min-share", "0.02"]) == 0
    printed = capsys.readouterr().out
    assert "answer token 0" in printed and "answer token 2" in printed and str(page) in printed
    assert len(_embedded(page.read_text(encoding="utf-8"))["views"]) == 2
    for token in (0, 2):
        data = json.loads((tmp_path / f"g-{token}.json").read_text(encoding="utf-8"))
        graph = igg.attribution_graph(model, ids, 4, token=token, steps=3)
        logit = next(node["node_id"] for node in data["nodes"] if node["feature_type"] == "logit")
        into = sum(link["weight"] for link in data["links"] if link["target"] == logit)
        assert into == pytest.approx(graph.delta, abs=1e-5 * float(graph.carried.abs().max()))
    assert igcli.main(["graph", "a prompt", "--json", str(file), "--tokens", "5"]) == 2
    assert "--tokens must be answer token indices in 0..4" in capsys.readouterr().err
    assert igcli.main(["graph", "a prompt", "--html", str(tmp_path / "g.txt")]) == 2
    assert "path must name an .html file" in capsys.readouterr().err
    assert igcli.main(["graph", "a prompt", "--json", str(file), "--fraction", "2"]) == 2
    assert "fraction must be a number in (0.0, 1.0], got 2.0" in capsys.readouterr().err
    for bad in (["graph", "a prompt"], ["graph", "a prompt", "--json", str(file), "--tokens", "-1"],
                ["graph", "a prompt", "--json", str(file), "--tokens", "0", "--word", "x"]):
        with pytest.raises(SystemExit):
            igcli.main(bad)
        assert capsys.readouterr().err.splitlines()[-1].startswith("iglens graph: error: ")


def test_imports_without_plotly_or_circuit_tracer():
    """plotly is imported inside the page writer only and circuit-tracer never: the module and the
    command line import without them."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['plotly'] = None; sys.modules['circuit_tracer'] = None; "
            "import iglens_view, iglens_cli; print(iglens_view.to_circuit_tracer)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ig.ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
