"""Bad and edge input on the newest surface (issue 47): the attribution graph and its adjacency, DPA's
scores and attribution, graph tables, shards, per-item records and model loading. Every case is a clear
error naming the bad value and the valid form, or a correct result; property tests (hypothesis) over
``Graph.adjacency``'s nodes, ``in_shard``'s arguments and ``ItemRecords``' settings and ids."""
import functools
import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import iglens_core as ig
import iglens_dpa as igdpa
import iglens_dpa_method as igdm
import iglens_graph as igg
import iglens_models as igm
import iglens_tables as igt
from conftest import sharp_model, tiny_model

FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LENGTH, PROMPT = 9, 6


def ids_of(seed=1, length=LENGTH):
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def graph_with_maps(token=1):
    return igg.attribution_graph(tiny_model("llama", dtype=torch.float64), ids_of(), PROMPT, token=token, maps=True)


class Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


# -- non-finite models: a clear error naming where and which parameter, never NaN results -----------------

def nan_model(dtype, where="down"):
    model = tiny_model("llama", dtype=dtype)
    with torch.no_grad():
        if where == "down":
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        elif where == "embedding":
            model.model.embed_tokens.weight[:] = float("inf")
        else:
            model.lm_head.weight[3, 0] = float("nan")
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_nan_weight_is_named_by_the_graph_and_dpa(dtype):
    model, ids = nan_model(dtype), ids_of()
    named = r"NaN or inf.*first at the output of block 2.*\['model\.layers\.1\.mlp\.down_proj\.weight'\]"
    with pytest.raises(ValueError, match=named):
        igg.attribution_graph(model, ids, PROMPT)
    with pytest.raises(ValueError, match=named):
        next(igg.attribution_graphs(model, ids, PROMPT))
    with pytest.raises(ValueError, match=named):
        igdm.dpa_attribution(model, ids[:, :PROMPT], 5)
    for method in ("ig_lens_graph", "dpa"):
        with pytest.raises(ValueError, match=named):
            igdpa.dpa_scores(model, ids[:, :PROMPT], 5, method)
    with pytest.raises(ValueError, match=r"NaN or inf at block 3's attention output.*down_proj\.weight"):
        igdpa.dpa_scores(model, ids[:, :PROMPT], 5, "atp")  # the gated run: its first attention output after block 2
    with pytest.raises(ValueError, match=r"NaN or inf in the 'attn_act' scores \(\d+ of the edges\).*down_proj"):
        igdpa.dpa_scores(model, ids[:, :PROMPT], 5, "attn_act")
    with pytest.raises(ValueError, match=r"NaN or inf in the 'mlp_act' scores \(\d+ of the neurons\).*down_proj"):
        igdpa.dpa_scores(model, ids[:, :PROMPT], 5, "mlp_act")


def test_an_inf_embedding_and_a_nan_head_are_named():
    with pytest.raises(ValueError, match=r"first at the token embeddings .*\['model\.embed_tokens\.weight'\]"):
        igg.attribution_graph(nan_model(torch.float32, "embedding"), ids_of(), PROMPT)
    with pytest.raises(ValueError, match=r"first at the token embeddings .*embed_tokens"):
        igdm.dpa_attribution(nan_model(torch.float32, "embedding"), ids_of()[:, :PROMPT], 5)
    with pytest.raises(ValueError, match=r"NaN or inf in the logits .*\['lm_head\.weight'\]"):
        igg.attribution_graph(nan_model(torch.float32, "head"), ids_of(), PROMPT)


def test_an_overflow_without_bad_weights_says_so():
    assert "overflow torch.float16" in str(igg.non_finite_error(tiny_model("llama", dtype=torch.float16), "here"))
    model = tiny_model("gpt2", dtype=torch.float16)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.weight.fill_(6e4)  # finite weights, states or a LayerNorm overflowing
    with pytest.raises(ValueError, match=r"(activations overflow torch\.float16|float16 model, an overflow).*model\.float"):
        igg.attribution_graph(model, ids_of(), PROMPT)


# -- bfloat16 and float16: computed in float64 from the model's own activations ------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_low_precision_models_give_the_graph_and_dpa(arch):
    """A bfloat16 or float16 model's graph, DPA attribution and graph scores: finite, near the float32 model's
    (the same weights, rounded; sharpened, so that delta is not tiny), the leaves adding up to delta to the
    rounding of its recorded states (measured: 0.3% of the carried map's size at most in bfloat16)."""
    ids = ids_of(2)
    wide = sharp_model(arch)
    want = igg.attribution_graph(wide, ids, PROMPT)
    want_dpa = igdm.dpa_attribution(wide, ids[:, :PROMPT], 5)
    for dtype in (torch.bfloat16, torch.float16):
        model = sharp_model(arch, dtype=dtype)
        assert igg.rebuild_tolerance(model) == 2 * torch.finfo(dtype).eps
        graph = igg.attribution_graph(model, ids, PROMPT)
        assert graph.delta == pytest.approx(want.delta, rel=0.05), dtype
        leaves = float(graph.embeddings.sum()) + graph.constants
        assert abs(leaves - graph.delta) < 0.02 * float(graph.carried[0].abs().sum()), dtype
        assert torch.isfinite(graph.edges).all() and torch.isfinite(graph.neurons).all()
        got = igdm.dpa_attribution(model, ids[:, :PROMPT], 5)
        assert got["logit"] == pytest.approx(want_dpa["logit"], rel=0.05), dtype
    scores = igdpa.dpa_scores(model, ids[:, :PROMPT], 5, "ig_lens_graph")  # the float16 model
    assert torch.isfinite(scores["edges"]).all() and torch.isfinite(scores["neurons"]).all()
    assert igg.rebuild_tolerance(wide) == igg.REBUILD_TOLERANCE
    assert igg.rebuild_tolerance(wide.double()) == igg.REBUILD_TOLERANCE


# -- memory: estimated first, refused with the size and the option -----------------------------------------

def test_edges_and_patterns_beyond_the_memory_budget(monkeypatch):
    model, ids = tiny_model("llama"), ids_of()
    one = 8 * 3 * 4 * LENGTH ** 2  # n x H x S^2 float64: the recorded patterns, and the edges as much again
    monkeypatch.setattr(igg, "GRAPH_MEMORY_BUDGET", one)
    with pytest.raises(ValueError, match=r"edges=True needs about .* GiB .*3 blocks x 4 heads x 9\^2 .*edges=False"):
        igg.attribution_graph(model, ids, PROMPT)
    assert igg.attribution_graph(model, ids, PROMPT, edges=False).edges is None
    monkeypatch.setattr(igg, "GRAPH_MEMORY_BUDGET", one - 1)
    with pytest.raises(ValueError, match=r"patterns alone need .*shorter sequence"):
        igg.attribution_graph(model, ids, PROMPT, edges=False)
    with pytest.raises(ValueError, match=r"edges=True needs about"):  # S = PROMPT + 1: its edges are over
        igdpa.dpa_scores(model, ids[:, :PROMPT], 5, "ig_lens_graph")
    monkeypatch.setattr(igg, "GRAPH_MEMORY_BUDGET", 2 * one)
    assert igg.attribution_graph(model, ids, PROMPT).edges.shape == (3, 4, LENGTH, LENGTH)


# -- Graph.adjacency trusts no node -------------------------------------------------------------------------

def test_adjacency_names_each_bad_node_and_the_valid_ranges():
    graph, other = graph_with_maps(1), graph_with_maps(2)
    head = r"a head node has block 1\.\.3, position 0\.\.8, index \(head\) 0\.\.3"
    for node, match in [(igg.Node("head", 1, 9, 0, 0.0), head), (igg.Node("head", 1, -1, 0, 0.0), head),
                        (igg.Node("head", 0, 1, 0, 0.0), head), (igg.Node("head", 1, 1, 4, 0.0), head),
                        (igg.Node("head", 1.0, 1, 1, 0.0), head),
                        (igg.Node("neuron", 1, 1, -1, 0.0), r"neuron node has .*index \(neuron\) 0\.\.63"),
                        (igg.Node("embedding", 1, 0, 0, 0.0), r"embedding node has block 0, position 0\.\.8"),
                        (igg.Node("logit", 4, 5, graph.target, graph.delta), r"logit node has block 4, position 6"),
                        (igg.Node("bias", 1, 0, 0, 0.0), r"kind must be one of"),
                        (("head", 1, 1), r"is not a Node \(kind, block, position, index, share\)")]:
        with pytest.raises(ValueError, match=r"nodes\[0\] = .*" + match):
            graph.adjacency([node])
    theirs = other.pruned(0.5)
    with pytest.raises(ValueError, match=r"nodes\[0\] = .* has share .* but this graph's .* a node of another graph"):
        graph.adjacency(theirs)
    with pytest.raises(ValueError, match=r"nodes must be a list of Node .*got Node"):
        graph.adjacency(graph.logit_node())
    with pytest.raises(ValueError, match=r"nodes must be a list of Node .*got str"):
        graph.adjacency("head")
    node = igg.Node("head", 2, 4, 1, graph.share_of("head", 2, 4, 1))
    assert node.share == float(graph.heads[1, 1, 4])
    with pytest.raises(ValueError, match=r"a head node has block 1\.\.3"):
        graph.share_of("head", 4, 0, 0)
    # numpy and 0-d tensor fields are numbers
    same = graph.adjacency([igg.Node("head", np.int64(2), torch.tensor(4), 1, torch.tensor(node.share))])
    assert torch.equal(same.embeddings, graph.adjacency([node]).embeddings)


@st.composite
def node_draws(draw):
    graph = graph_with_maps(1)
    n, H, S, d_ff = graph.n_layers, graph.heads.shape[1], len(graph.input_ids), graph.neurons.shape[-1]
    kind = draw(st.sampled_from(["head", "neuron", "embedding", "logit", "edge", ""]))
    block = draw(st.one_of(st.integers(-2, n + 2), st.sampled_from([1.5, None, True, "1"])))
    position = draw(st.one_of(st.integers(-2, S + 1), st.sampled_from([graph.position, 2.0])))
    index = draw(st.one_of(st.integers(-2, d_ff + 1), st.integers(-1, H), st.just(graph.target)))
    how = draw(st.sampled_from(["own", "own", "off", "nan"]))
    return kind, block, position, index, how


def valid_node(graph, kind, block, position, index) -> bool:
    n, H, S, d_ff = graph.n_layers, graph.heads.shape[1], len(graph.input_ids), graph.neurons.shape[-1]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (block, position, index)):
        return False
    if kind == "logit":
        return (block, position, index) == (n + 1, graph.position, graph.target)
    if kind == "embedding":
        return block == 0 and index == 0 and 0 <= position < S
    if kind in ("head", "neuron"):
        return 1 <= block <= n and 0 <= position < S and 0 <= index < (H if kind == "head" else d_ff)
    return False


@FEW
@given(node_draws())
def test_adjacency_accepts_exactly_this_graphs_nodes(draw):
    """Any node: a ValueError naming ``nodes[0]`` unless kind, block, position and index are in range and the
    share is this graph's; then its row splits that share exactly over the embeddings and constants."""
    graph = graph_with_maps(1)
    kind, block, position, index, how = draw
    valid = valid_node(graph, kind, block, position, index)
    share = graph.share_of(kind, block, position, index) if valid else 0.0
    share = {"own": share, "off": share + 1e-3 * (abs(share) + 1e-3), "nan": math.nan}[how]
    if not valid or how != "own":
        with pytest.raises(ValueError, match=r"nodes\[0\] = .*(is not a node of this graph|a node of another graph)"):
            graph.adjacency([(kind, block, position, index, share)])
        return
    adj = graph.adjacency([(kind, block, position, index, share)])
    assert adj.nodes[0].share == share
    if kind in ("head", "neuron", "logit"):
        total = float(adj.embeddings[0].sum() + adj.constants[0])
        assert total == pytest.approx(share, abs=1e-12 * (abs(graph.delta) + 1e-30) + 1e-15)


# -- graph tables and shards --------------------------------------------------------------------------------

def test_graph_frame_takes_one_graph_and_refuses_what_is_not_one():
    graph = igg.attribution_graph(tiny_model("llama"), ids_of(), PROMPT, edges=False)
    pd.testing.assert_frame_equal(igt.graph_frame(graph, Tokenizer(), 3), igt.graph_frame([graph], Tokenizer(), 3))
    with pytest.raises(ValueError, match=r"tokenizer must be the model's tokenizer .*got NoneType"):
        igt.graph_frame([graph], None)
    with pytest.raises(ValueError, match=r"graphs must be iglens_graph\.Graph objects .*got dict"):
        igt.graph_frame({"a": graph}, Tokenizer())
    with pytest.raises(ValueError, match=r"graphs\[1\] must be an iglens_graph\.Graph .*got dict"):
        igt.graph_frame([graph, {"edges": None}], Tokenizer())
    with pytest.raises(ValueError, match=r"graphs must be .*got int"):
        igt.graph_frame(3, Tokenizer())


@FEW
@given(st.integers(0, 10 ** 12), st.integers(1, 40), st.booleans())
def test_in_shard_puts_every_item_in_exactly_one_shard(index, k, numpy_index):
    index = np.int64(index) if numpy_index else index
    owners = [r for r in range(k) if igt.in_shard(index, f"{r}/{k}")]
    assert owners == [int(index) % k] and igt.in_shard(index, "")


@FEW
@given(st.one_of(st.floats(allow_nan=True), st.text(max_size=5), st.none(), st.booleans(), st.integers(max_value=-1),
                 st.lists(st.integers(0, 3), max_size=2)))
def test_in_shard_refuses_an_index_that_is_not_an_item_position(index):
    with pytest.raises(ValueError, match=r"index must be an item's 0-based position, an integer >= 0, got"):
        igt.in_shard(index, "0/2")


@FEW
@given(st.one_of(st.text(alphabet="0123456789/ ١٣²x-", max_size=7), st.text(max_size=6)))
def test_in_shard_reads_only_ascii_r_over_k(shard):
    match = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", shard, re.ASCII)
    if shard == "" or (match and int(match[1]) < int(match[2])):
        assert igt.in_shard(7, shard) == (shard == "" or 7 % int(match[2]) == int(match[1]))
    else:
        with pytest.raises(ValueError, match=r"shard must be 'r/k' with integers 0 <= r < k in ASCII digits"):
            igt.in_shard(7, shard)


# -- per-item records ---------------------------------------------------------------------------------------

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), st.floats(allow_nan=True),
                              st.text(max_size=8)),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
NUMPY = st.one_of(st.integers(-1000, 1000).map(np.int64), st.floats(-1e6, 1e6, width=32).map(np.float32),
                  st.floats(allow_nan=True).map(np.float64), st.lists(st.integers(0, 9), max_size=3).map(np.array))


@FEW
@given(st.dictionaries(st.text(max_size=6), st.one_of(JSON, NUMPY), max_size=4))
def test_records_reopen_with_the_same_settings_nan_and_numpy_included(settings_):
    with tempfile.TemporaryDirectory() as folder:
        records = igt.ItemRecords(folder, settings_)
        records.save("a", t=pd.DataFrame({"x": [1.0]}))
        again = igt.ItemRecords(folder, settings_)
        assert "a" in again
        stored = json.loads((Path(folder) / "settings.json").read_text())
        changed = dict(settings_, **{"__other__": 1}) if "__other__" not in stored else {}
        with pytest.raises(ValueError, match=r"made with other settings"):
            igt.ItemRecords(folder, changed)


ID = st.one_of(st.text(max_size=20), st.text(min_size=150, max_size=400), st.text(alphabet="./%=~ é", max_size=300),
               st.integers(-10 ** 9, 10 ** 9))


@FEW
@given(ID, ID)
def test_records_keep_any_id_apart(a, b):
    """Any id (text of any length, unicode, path characters, integers) saves and loads under its own file
    name of at most 255 bytes; two ids that differ as text never share a record."""
    with tempfile.TemporaryDirectory() as folder:
        records = igt.ItemRecords(folder, {})
        records.save(a, t=pd.DataFrame({"x": [1]}))
        assert a in records and records.load(a)["t"]["x"].tolist() == [1]
        assert all(len(p.name.encode()) <= 255 for p in Path(folder).iterdir())
        assert (b in records) == (str(b) == str(a))


def test_records_name_corrupted_files_and_bad_folders(tmp_path):
    settings_ = {"steps": 16, "floor": float("nan"), "seed": np.int64(3), "shape": np.array([1, 2])}
    records = igt.ItemRecords(tmp_path / "r", settings_)
    assert igt.ItemRecords(tmp_path / "r", settings_) is not None  # NaN reopens ("nan in folder, nan now")
    records.save("x.1", curves=pd.DataFrame({"v": [1.0]}))
    (tmp_path / "r" / "x.1.curves.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"record of item 'x\.1' is unreadable: .*x\.1\.curves\.parquet .*ArrowInvalid"
                                         r".*delete .*x\.1\.done\.parquet to compute the item again"):
        records.load("x.1")
    records.save("y", curves=pd.DataFrame({"v": [1.0]}))
    (tmp_path / "r" / "y.done.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"item 'y' is unreadable: .*y\.done\.parquet"):
        records.load("y")
    records.save("z", curves=pd.DataFrame({"v": [1.0]}))
    pd.DataFrame({"other": [1]}).to_parquet(tmp_path / "r" / "z.done.parquet")
    with pytest.raises(ValueError, match=r"done marker .*z\.done\.parquet of item 'z' does not list its tables"):
        records.load("z")
    (tmp_path / "r" / "settings.json").write_text("{\"steps\": 16,")
    with pytest.raises(ValueError, match=r"settings\.json \(the records' settings\) is not readable JSON .*another folder"):
        igt.ItemRecords(tmp_path / "r", settings_)
    (tmp_path / "r" / "settings.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"settings\.json holds list, not the settings' JSON object"):
        igt.ItemRecords(tmp_path / "r", settings_)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "settings.json").write_text("{}")
    (tmp_path / "m" / "model.json").write_text("[0.1,")
    with pytest.raises(ValueError, match=r"model\.json \(the records' model fingerprint\) is not readable JSON"):
        igt.ItemRecords(tmp_path / "m", {}, model=tiny_model("llama"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"folder '.*file' is a file: give a folder path"):
        igt.ItemRecords(tmp_path / "file", {})
    with pytest.raises(ValueError, match=r"cannot make the records folder '.*file/sub'"):
        igt.ItemRecords(tmp_path / "file" / "sub", {})
    for bad, match in [({"x": object()}, r"settings must hold JSON values .*object"), ([1], r"settings must be a dict"),
                       ({(1, 2): 3}, r"settings must hold JSON values .*keys must be")]:
        with pytest.raises(ValueError, match=match):
            igt.ItemRecords(tmp_path / "s", bad)
    records.save("\ud800x", curves=pd.DataFrame({"v": [3.0]}))  # a lone surrogate
    assert records.load("\ud800x")["curves"]["v"][0] == 3.0
    long_id = "q" * 300
    records = igt.ItemRecords(tmp_path / "long", {})
    records.save(long_id, curves=pd.DataFrame({"v": [2.0]}))
    assert long_id in records and long_id[:-1] not in records and records.load(long_id)["curves"]["v"][0] == 2.0
    with pytest.raises(ValueError, match=r"at most 40 characters"):
        records.save("a", **{"t" * 41: pd.DataFrame()})


# -- model loading ------------------------------------------------------------------------------------------

def test_model_paths_name_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "config.json").write_text("{}")
    (tmp_path / "weights.bin").write_text("x")
    (tmp_path / "model.gguf").write_text("x")
    cases = [(str(tmp_path / "missing"), r"model folder '.*missing' does not exist .*config\.json"),
             ("./no/such/folder", r"model folder '\./no/such/folder' does not exist"),
             (str(tmp_path / "weights.bin"), r"is a file, not a folder: give a folder holding config\.json"),
             (str(tmp_path / "model.gguf"), r"is a file, not a folder.*convert_gguf\('.*model\.gguf', out_dir\)"),
             (str(tmp_path / "only"), r"model folder '.*only' lacks the weights and the tokenizer"),
             ("bad name!", r"neither a packaged model .*nor a Hugging Face id \(owner/name\)"),
             ("no-such/model-xyz", r"'no-such/model-xyz' is not available offline")]
    for name, match in cases:
        with pytest.raises(FileNotFoundError, match=match):
            ig.load_model(name)
    with pytest.raises(FileNotFoundError, match=r"convert_gguf needs a \.gguf file on disk, got '.*nope\.gguf' "
                                                r"\(no such file\)"):
        igm.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"\(a folder\)"):
        igm.convert_gguf(tmp_path, tmp_path / "out")


def test_a_saved_model_folder_loads(tmp_path):
    """The checks accept what save_pretrained writes (config, safetensors, tokenizer files)."""
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(FileNotFoundError, match=r"lacks the tokenizer"):
        ig.resolve_model_path(str(tmp_path / "saved"))
    (tmp_path / "saved" / "tokenizer_config.json").write_text("{}")
    assert ig.resolve_model_path(str(tmp_path / "saved")) == str(tmp_path / "saved")
