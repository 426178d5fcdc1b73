"""The interactive view: the file holds the attribution's numbers, loads nothing, rejects bad input."""
import json
import re

import numpy as np
import pytest
import torch

import iglens_core as ig
import iglens_cli as igcli
import iglens_data as igd
import iglens_tables as igt
import iglens_plot as igp
from conftest import random_trace, tiny_model


def _figure(text: str):
    """The figure's data and layout as written by plotly into the page."""
    found = re.search(r'Plotly\.newPlot\(\s*"iglens",\s*', text)
    assert found, "no Plotly.newPlot call for the view's div"
    decoder = json.JSONDecoder()
    data, end = decoder.raw_decode(text, found.end())
    layout, _ = decoder.raw_decode(text[end:].lstrip().lstrip(",").lstrip())
    return data, layout


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model = tiny_model("gemma3", seed=3)
    trace = random_trace(model, seed=4, sublayer=True)
    layer = ig.ig_lens(model, trace)
    sublayer = ig.ig_lens(model, trace, resolution="sublayer")
    gen = torch.Generator().manual_seed(5)
    parts = torch.randn(len(trace.targets), 7, generator=gen)  # an array view, e.g. components
    tokens = [f"tok{t} <&>" for t in range(len(trace.targets))]
    path = igp.to_html(layer, tokens, tmp_path_factory.mktemp("html") / "view.html",
                      sublayer=sublayer, views={"parts": (parts, [f"c{i}" for i in range(7)])})
    return path, layer, sublayer, parts, tokens


def test_file_holds_the_attribution(written):
    path, layer, sublayer, parts, tokens = written
    data, layout = _figure(path.read_text(encoding="utf-8"))
    heat = {trace["name"]: trace for trace in data if trace["colorscale"][0][1] != "#440154"}
    lens = {trace["name"]: trace for trace in data if trace["colorscale"][0][1] == "#440154"}
    assert sorted(heat) == ["layer", "parts", "sublayer"] and sorted(lens) == ["layer", "sublayer"]
    for name, attribution in (("layer", layer), ("sublayer", sublayer)):
        np.testing.assert_array_equal(np.array(heat[name]["z"], dtype=np.float32),
                                      attribution.values.numpy())
        np.testing.assert_array_equal(np.array(lens[name]["z"], dtype=np.float32),
                                      attribution.lens.numpy())
        cells = heat[name]["customdata"]  # token, segment, lens start, lens end, row sum, Δp
        T, K = attribution.values.shape
        for t in range(T):
            for j in range(K):
                token, label, start, end, row_sum, delta_p = cells[t][j]
                assert label == attribution.labels[j] and token.startswith(f"&#x27;tok{t} &lt;")
                assert start == float(attribution.lens[t, j]) and end == float(attribution.lens[t, j + 1])
                assert row_sum == pytest.approx(float(attribution.values[t].double().sum()), abs=1e-6)
                assert delta_p == float(attribution.delta_p[t])
    np.testing.assert_allclose(np.array(heat["parts"]["z"]), parts.numpy().astype(np.float64))
    # one button per view; each shows its heatmap and a lens, and labels its last segment
    buttons = layout["updatemenus"][0]["buttons"]
    assert [b["label"] for b in buttons] == ["layer", "sublayer", "parts"]
    for button, attribution in zip(buttons, (layer, sublayer)):
        visible, axes = button["args"][0]["visible"], button["args"][1]
        shown = [trace["name"] for trace, seen in zip(data, visible) if seen]
        assert shown == [button["label"]] * 2
        assert axes["xaxis.ticktext"][-1] == attribution.labels[-1]
    assert [t["name"] for t, seen in zip(data, buttons[2]["args"][0]["visible"]) if seen] == ["layer", "parts"]
    assert [trace["visible"] for trace in data] == buttons[0]["args"][0]["visible"]


def test_opens_without_network(written):
    text = written[0].read_text(encoding="utf-8")
    assert "plotly.js v" in text  # the library itself is embedded
    # outside the embedded scripts' bodies, no tag may point at another host
    tags = re.sub(r"(<script[^>]*>).*?</script>", r"\1", text, flags=re.S)
    external = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", tags, flags=re.I)
    assert external == [], external
    assert re.findall(r"<script[^>]*\ssrc\s*=", text, flags=re.I) == []
    assert re.findall(r"<link\b", tags, flags=re.I) == []
    assert re.findall(r"@import|url\(\s*['\"]?(?:https?:)?//", tags, flags=re.I) == []


def test_bad_input(tmp_path):
    model = tiny_model("llama")
    trace = random_trace(model)
    layer = ig.ig_lens(model, trace)
    tokens = [str(t) for t in range(len(trace.targets))]
    with pytest.raises(ValueError, match=r"folder .*missing.* does not exist"):
        igp.to_html(layer, tokens, tmp_path / "missing" / "view.html")
    with pytest.raises(ValueError, match=r"path must name an \.html file, got '.*view\.png'"):
        igp.to_html(layer, tokens, tmp_path / "view.png")
    with pytest.raises(ValueError, match=rf"tokens has {len(tokens) - 1} entries, the attribution "
                                         rf"T = {len(tokens)}"):
        igp.to_html(layer, tokens[:-1], tmp_path / "view.html")
    other = ig.ig_lens(model, random_trace(model, seed=9))
    with pytest.raises(ValueError, match="view 'other' attributes targets"):
        igp.to_html(layer, tokens, tmp_path / "view.html", views={"other": other})
    with pytest.raises(ValueError, match=r"view 'parts' must be .* got values \(3, 2\) and 2 labels"):
        igp.to_html(layer, tokens, tmp_path / "view.html", views={"parts": (np.zeros((3, 2)), ["a", "b"])})
    with pytest.raises(ValueError, match="plotlyjs must be True or 'directory', got 'cdn'"):
        igp.to_html(layer, tokens, tmp_path / "view.html", plotlyjs="cdn")
    assert not (tmp_path / "view.html").exists()


def _stub_cli(monkeypatch, seed):
    """The command line on a tiny Llama and 9 random token ids (prompt 4), model and tokenizer stubbed."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
    monkeypatch.setattr(igcli, "encode", lambda *args, **kwargs: (ids, 4))
    monkeypatch.setattr(ig.Trace, "tokens", lambda self, tokenizer: [str(t) for t in self.targets.tolist()])

    class Decode:
        def decode(self, ids):
            return str(list(ids))
    monkeypatch.setattr(igcli, "load_model", lambda name: (model, Decode()))
    return model, ids


def test_cli_writes_the_view(tmp_path, monkeypatch, capsys):
    """``--html`` writes the layer and sublayer views of the prompt (model and tokenizer stubbed)."""
    model, ids = _stub_cli(monkeypatch, seed=2)
    out = tmp_path / "cli.html"
    assert igcli.main(["a prompt", "--html", str(out)]) == 0
    data, _ = _figure(out.read_text(encoding="utf-8"))
    trace = ig.collect(model, ids, 4, sublayer=True)
    expected = ig.ig_lens(model, trace, resolution="sublayer")
    sub = next(t for t in data if t["name"] == "sublayer" and "zmid" in t)
    np.testing.assert_allclose(np.array(sub["z"]), expected.values.numpy(), atol=1e-7, rtol=0)
    assert igcli.main(["a prompt", "--html", str(tmp_path / "cli.txt")]) == 2
    assert "path must name an .html file" in capsys.readouterr().err


def test_modules_import_without_plotly():
    """plotly is imported inside to_html only: the core and the view module import without it."""
    import subprocess
    import sys
    code = "import sys; sys.modules['plotly'] = None; import iglens_core, iglens_plot; print(iglens_plot.to_html)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ig.ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


def _embedded(text: str, div: str):
    """The JSON of ``<script type="application/json" id=div>`` in the page."""
    found = re.search(rf'<script type="application/json" id="{div}">(.*?)</script>', text, flags=re.S)
    assert found, f"no {div} script"
    return json.loads(found.group(1))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_source_panel_round_trips(tmp_path, arch):
    """The source panel's embedded numbers and its heatmaps are the components' sources summed over
    heads, its bars and rest ``by_source``; the main view is unchanged."""
    model = tiny_model(arch, seed=6)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=gen)
    trace = ig.collect_components(model, ids, 6, sources=True)
    with torch.no_grad():
        parts = ig.components(model, trace, resolution="source", steps=4, estimator="prediction_aware",
                              quantity="logprob")
    layer = ig.ig_lens(model, ig.collect(model, ids, 6), quantity="logprob")
    tokens = [f"a{t}</script>" for t in range(len(trace.targets))]
    source_tokens = [f"s{s} <&>" for s in range(ids.shape[1])]
    path = igp.to_html(layer, tokens, tmp_path / "sources.html", sources=parts, source_tokens=source_tokens)
    text = path.read_text(encoding="utf-8")
    data = _embedded(text, "iglens-sources-data")
    maps = parts.sources.double().sum(2)  # (T, n, S), independently of the panel's code
    assert data["tokens"] == tokens and data["source_tokens"] == source_tokens
    assert data["blocks"] == [f"L{layer}" for layer in range(1, model.config.num_hidden_layers + 1)]
    np.testing.assert_array_equal(np.array(data["maps"]), maps.numpy())
    np.testing.assert_array_equal(np.array(data["by_source"]), parts.by_source().double().numpy())
    np.testing.assert_allclose(np.array(data["by_source"]).sum(-1), parts.delta_p.double().numpy(), atol=1e-6)
    found = re.search(r'Plotly\.newPlot\(\s*"iglens-sources",\s*', text)
    figure, end = json.JSONDecoder().raw_decode(text, found.end())
    layout, _ = json.JSONDecoder().raw_decode(text[end:].lstrip().lstrip(",").lstrip())
    bars, heats = figure[0::2], figure[1::2]
    assert len(heats) == len(tokens) and [b["type"] for b in bars] == ["bar"] * len(tokens)
    for t, (bar, heat) in enumerate(zip(bars, heats)):
        np.testing.assert_array_equal(np.array(heat["z"]), maps[t].numpy())
        np.testing.assert_array_equal(np.array(bar["y"]), parts.by_source()[t, :-1].double().numpy())
    buttons = layout["updatemenus"][0]["buttons"]
    assert [button["args"][0]["visible"].index(True) for button in buttons] == list(range(0, 2 * len(tokens), 2))
    assert "Δ log p" in buttons[0]["args"][1]["title.text"]
    main, main_layout = _figure(text)  # the first view: layer attribution, in nats
    np.testing.assert_array_equal(np.array(main[0]["z"], dtype=np.float32), layer.values.numpy())
    assert "attribution (Δ log-probability (nats))" in [a["text"] for a in main_layout["annotations"]]
    assert "zmin" not in main[1]  # the lens is not clipped to [0, 1] for log-probabilities


def test_source_panel_bad_input(tmp_path):
    model = tiny_model("llama", seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    trace = ig.collect_components(model, ids, 5, sources=True)
    heads = ig.components(model, trace, resolution="head", steps=2)
    sources = ig.components(model, trace, resolution="source", steps=2)
    layer = ig.ig_lens(model, ig.collect(model, ids, 5))
    tokens = [str(t) for t in range(len(trace.targets))]
    with pytest.raises(ValueError, match=r"sources must hold sources: components\(\.\.\., resolution='source'"):
        igp.to_html(layer, tokens, tmp_path / "v.html", sources=heads, source_tokens=["x"] * 9)
    with pytest.raises(ValueError, match=r"source_tokens must give the text of each of the S = 9 positions, got 8"):
        igp.to_html(layer, tokens, tmp_path / "v.html", sources=sources, source_tokens=["x"] * 8)
    other = ig.ig_lens(model, ig.collect(model, ids, 4))
    with pytest.raises(ValueError, match="sources attribute targets"):
        igp.to_html(other, tokens + ["x"], tmp_path / "v.html", sources=sources, source_tokens=["x"] * 9)
    with pytest.raises(ValueError, match=r"quantity must be one of \('prob', 'logprob'\), got 'logit'"):
        igp.to_html(layer, tokens, tmp_path / "v.html", quantity="logit")
    assert not (tmp_path / "v.html").exists()


def test_cli_prompt_source_panel(tmp_path, monkeypatch, capsys):
    """``iglens PROMPT --html F --resolution source`` adds the panel of components(resolution="source")."""
    model, ids = _stub_cli(monkeypatch, seed=3)
    out = tmp_path / "cli.html"
    assert igcli.main(["a prompt", "--html", str(out), "--resolution", "source", "--steps", "3"]) == 0
    data = _embedded(out.read_text(encoding="utf-8"), "iglens-sources-data")
    with torch.no_grad():
        want = ig.components(model, ig.collect_components(model, ids, 4, sources=True), resolution="source",
                             steps=3, estimator="prediction_aware")
    np.testing.assert_allclose(np.array(data["by_source"]), want.by_source().double().numpy(), atol=1e-7, rtol=0)
    assert data["source_tokens"] == [str([i]) for i in ids[0].tolist()]
    for more in (["--resolution", "head", "--html", str(out)], ["--resolution", "source"]):
        with pytest.raises(SystemExit):
            igcli.main(["a prompt", *more])
        assert "with a prompt, --resolution takes only source, with --html" in capsys.readouterr().err
    assert igcli.main(["a prompt", "--html", str(out), "--resolution", "source", "--baseline", "zero"]) == 2
    assert "needs --baseline embedding, got 'zero'" in capsys.readouterr().err


def test_figures_name_the_quantity():
    """plot_heatmap's colour bars and row labels name f; an attribution rebuilt from a table (which
    says "prob" whatever the table held) is labelled by the quantity passed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    model = tiny_model("llama", seed=2)
    trace = random_trace(model, seed=3)
    tokens = [str(t) for t in range(len(trace.targets))]

    def labels(fig):
        axes = fig.axes + [child for ax in fig.axes for child in ax.child_axes]  # the row sums' axis too
        return [ax.get_ylabel() for ax in axes] + [t.get_text() for ax in axes for t in ax.get_yticklabels()]
    for quantity, colour_bar, row in (("prob", "attribution (Δ probability)", "Δp="),
                                      ("logprob", "attribution (Δ log-probability (nats))", "Δ log p=")):
        attribution = ig.ig_lens(model, trace, quantity=quantity)
        rebuilt = igt.attribution_from_frame(attribution.to_frame())
        for fig in (igp.plot_heatmap(attribution, tokens), igp.plot_heatmap(rebuilt, tokens, quantity=quantity)):
            found = labels(fig)
            assert colour_bar in found and any(row in text for text in found), found
            plt.close(fig)
    foil = ig.ig_lens(model, trace, quantity="logprob", foil=(trace.targets + 1) % model.config.vocab_size)
    fig = igp.plot_heatmap(foil, tokens)
    assert "target logit difference z_y − z_foil" in labels(fig)
    plt.close(fig)
