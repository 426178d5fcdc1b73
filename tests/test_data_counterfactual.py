"""attribute_dataset(resolution="graph", corrupted_column=) and --corrupted-column: each answer token's
counterfactual graph as graph_frame's rows, equal to counterfactual_graph of the row alone; bad rows are
error rows, bad arguments ValueErrors naming the flag or the column; resume refuses another column."""
import numpy as np
import pandas as pd
import pytest
import torch

import iglens_cli as igcli
import iglens_core as ig
import iglens_counterfactual as igcf
import iglens_data as igd
import iglens_stats as igs
import iglens_tables as igt
from conftest import tiny_model
from test_dataset import VOCAB, model_dir, tokenizer  # noqa: F401 (fixtures: the packaged tokenizer, a tiny Llama dir)

# prompt, answer, corrupted: each pair of the same token length with the packaged chat template (37 tokens)
PAIRS = pd.DataFrame(dict(id=["fr", "de"], prompt=["What is the capital of France?", "What is the capital of Germany?"],
                          answer=["Paris", "Berlin is"],
                          corrupted=["What is the capital of Japan?", "What is the capital of Italy?"],
                          foil=[None, " Lyon"]))


def _check_rows(model, tokenizer, item, rows, top_k, quantity, steps, chat=True, rtol=1e-12):
    """One item's rows against counterfactual_graph of each answer token, computed here from the row alone."""
    ids, prompt_len = igd.encode(tokenizer, item.prompt, item.answer, chat=chat)
    bad = torch.tensor([igd.prompt_token_ids(tokenizer, item.corrupted, chat) + ids[0, prompt_len:].tolist()])
    assert bad.shape == ids.shape and not torch.equal(bad, ids)  # the pair is what the test says it is
    foil = tokenizer(item.foil, add_special_tokens=False)["input_ids"][0] if isinstance(item.foil, str) else None
    T = ids.shape[1] - prompt_len
    assert sorted(rows["token_index"].unique()) == list(range(T))
    for j in range(T):
        t = prompt_len - 1 + j
        graph = igcf.counterfactual_graph(model, ids[:, :t + 1], bad[:, :t + 1], int(ids[0, t + 1]), quantity=quantity,
                                          foil=foil, steps=steps)
        got = rows[rows["token_index"] == j]
        scale = max(float(graph.carried.abs().max()), abs(graph.delta))
        tol = rtol * scale
        assert (got["position"] == t).all() and (got["token"] == tokenizer.decode([int(ids[0, t + 1])])).all()
        for name, want in (("delta_p", graph.delta), ("parts_sum", float(graph.carried[0].sum())),
                           ("f_clean", graph.f_clean), ("f_corrupted", graph.f_corrupted)):
            assert got[name].to_numpy() == pytest.approx(want, rel=rtol, abs=tol), name
        assert got["gap"].to_numpy() == pytest.approx(graph.gap, abs=tol)
        carried = got[got["kind"] == "carried"].pivot(index="node", columns="source_position", values="share")
        assert carried.shape == (graph.n_layers + 1, t + 1)
        np.testing.assert_allclose(carried.to_numpy(float), graph.carried.numpy(), rtol=rtol, atol=tol)
        assert (carried.to_numpy(float)[:, :graph.first] == 0).all()  # nothing before the first swapped token
        below = got[got["kind"] == "gaps_below"].set_index("node")["share"]
        np.testing.assert_allclose(carried.sum(1).to_numpy(float) + below.to_numpy(float),
                                   float(graph.carried[0].sum()), rtol=0, atol=tol)
        # the top k: embeddings, heads, neurons by |share| (no constants in a difference), then the rest
        n, H, S = graph.heads.shape
        flat = torch.cat([graph.embeddings, graph.heads.reshape(-1), graph.neurons.reshape(-1)])
        picked = igs.top_parts(flat, top_k)
        top = got[got["kind"].isin(["embedding", "head", "neuron"])]
        assert top["rank"].tolist() == list(range(1, len(picked) + 1))
        where = []
        for row in top.itertuples():
            s, b = int(row.source_position), (int(row.block) - 1 if row.kind != "embedding" else None)
            where.append(s if row.kind == "embedding" else S + (b * H + int(row.head)) * S + s if row.kind == "head"
                         else S + n * H * S + (b * S + s) * graph.neurons.shape[-1] + int(row.neuron))
        assert where == picked.tolist()
        np.testing.assert_allclose(top["share"].to_numpy(float), flat[picked].numpy(), rtol=rtol, atol=tol)
        rest = got[got["kind"] == "rest"]["share"]
        assert len(rest) == 1 and rest.iloc[0] + top["share"].sum() == pytest.approx(graph.delta, abs=tol)
        assert set(got["kind"]) <= {"embedding", "head", "neuron", "rest", "carried", "gaps_below"}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_equal_the_counterfactual_graph_of_each_token(tokenizer, arch):
    """float64: every item's rows equal counterfactual_graph of each answer token alone, to float64 rounding
    (1e-12 relative); one item with a foil, one with a three-token answer."""
    model = tiny_model(arch, seed=7, vocab_size=VOCAB, dtype=torch.float64)
    results, errors, parts = igd.attribute_dataset(model, tokenizer, PAIRS, steps=3, batch_size=2, progress=False,
                                                   quantity="logprob", resolution="graph", top_k=5,
                                                   corrupted_column="corrupted")
    assert errors.empty and list(parts["id"].unique()) == list(PAIRS["id"])
    assert list(parts.columns) == igt.PART_COLUMNS[:-1] + igt.CONTRAST_COLUMNS
    assert set(parts["kind"]) >= {"head", "rest", "carried", "gaps_below"}
    for item in PAIRS.itertuples():
        rows = parts[parts["id"] == item.id]
        assert (rows["foil"].isna() if item.foil is None else rows["foil"] == item.foil).all()
        _check_rows(model, tokenizer, item, rows, 5, "logprob", 3)


def test_graph_frame_of_a_counterfactual_graph_without_parts(tokenizer):
    """graph_frame reads a CounterfactualGraph by its fields: without parts only embeddings are ranked, and
    only the swapped token's is not 0 (every other embedding is the same in both runs); token_index is null
    (the graph does not know the prompt's length)."""
    model = tiny_model("llama", seed=3, vocab_size=VOCAB, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    bad = ids.clone()
    bad[0, 2] = (bad[0, 2] + 5) % VOCAB
    graph = igcf.counterfactual_graph(model, ids, bad, 11, quantity="logprob", parts=False)
    frame = igt.graph_frame(graph, tokenizer, 3)
    assert list(frame.columns) == igt.GRAPH_FRAME_COLUMNS + igt.CONTRAST_COLUMNS
    top = frame[frame["rank"].notna()]
    assert top["kind"].tolist() == ["embedding"] and top["source_position"].tolist() == [2] == [graph.first]
    assert top["share"].iloc[0] == float(graph.carried[0, 2])
    assert frame["token_index"].isna().all() and (frame["position"] == 6).all()
    assert (frame["token"] == tokenizer.decode([11])).all()


def test_cli_corrupted_column(tmp_path, model_dir, tokenizer, capsys):
    """``iglens --dataset F --resolution graph --corrupted-column C --out X.parquet``: runs, writes each answer
    token's counterfactual rows (checked against counterfactual_graph), and a resume with another column is
    refused naming it."""
    csv, out = tmp_path / "pairs.csv", tmp_path / "cf.parquet"
    data = PAIRS.rename(columns={"corrupted": "swap"})
    data.to_csv(csv, index=False)
    argv = ["--dataset", str(csv), "--out", str(out), "--model", str(model_dir), "--steps", "2", "--quantity",
            "logprob", "--resolution", "graph", "--top-k", "3", "--corrupted-column", "swap"]
    assert igcli.main(argv) == 0
    printed = capsys.readouterr().out
    parts = pd.read_parquet(igt.parts_path(out))
    assert f"{len(parts)} graph rows (top 3 per answer token, carried map, rest, counterfactual graphs)" in printed
    assert list(parts["id"].unique()) == ["fr", "de"] and pd.read_parquet(igt.errors_path(out)).empty
    model, _ = ig.load_model(str(model_dir))
    for item in PAIRS.itertuples():
        _check_rows(model, tokenizer, item, parts[parts["id"] == item.id], 3, "logprob", 2, rtol=1e-9)
    data["other"] = data["swap"]
    data.to_csv(csv, index=False)
    assert igcli.main(argv[:-1] + ["other", "--resume"]) == 2
    assert "corrupted_column: 'swap' in the shards, 'other' now" in capsys.readouterr().err


def test_bad_rows_are_error_rows(tokenizer):
    """A corrupted prompt of another token length is an error row naming both lengths; an empty one names the
    column; the other rows run."""
    model = tiny_model("llama", seed=7, vocab_size=VOCAB, dtype=torch.float64)
    items = pd.concat([PAIRS.iloc[:1], pd.DataFrame(dict(
        id=["long", "none"], prompt=["Who wrote Hamlet?", "What is the capital of Spain?"], answer=["Shakespeare", "Madrid"],
        corrupted=["What is the capital of Vietnam?", None], foil=[None, None]))], ignore_index=True)
    assert len(igd.prompt_token_ids(tokenizer, "Who wrote Hamlet?", True)) == 34
    assert len(igd.prompt_token_ids(tokenizer, "What is the capital of Vietnam?", True)) == 37
    _, errors, parts = igd.attribute_dataset(model, tokenizer, items, steps=2, progress=False, quantity="logprob",
                                             resolution="graph", top_k=2, corrupted_column="corrupted")
    assert list(parts["id"].unique()) == ["fr"] and errors["id"].tolist() == ["long", "none"]
    assert "tokenises to 37 prompt tokens, the prompt 'Who wrote Hamlet?' to 34: positions must align" in errors["error"][0]
    assert errors["error"][1] == "no corrupted prompt in column 'corrupted'"


def test_bad_arguments_name_the_flag_and_the_column(tmp_path, tokenizer, capsys):
    model = tiny_model("llama", seed=7, vocab_size=VOCAB)
    for resolution in (None, "head"):
        with pytest.raises(ValueError, match=r"corrupted_column= \(--corrupted-column\) .* needs resolution='graph' "
                                             rf"\(--resolution graph\), got resolution={resolution!r}"):
            igd.attribute_dataset(model, tokenizer, PAIRS, progress=False, resolution=resolution,
                                  corrupted_column="corrupted")
    with pytest.raises(ValueError, match=r"needs a corrupted column 'swap' \(--corrupted-column / corrupted_column= "
                                         r"names another\), got columns \['id', 'prompt', 'answer', 'corrupted', 'foil'\]"):
        igd.attribute_dataset(model, tokenizer, PAIRS, progress=False, resolution="graph", corrupted_column="swap")
    csv = tmp_path / "pairs.csv"
    PAIRS.to_csv(csv, index=False)
    for extra in ([], ["--resolution", "head"]):
        with pytest.raises(SystemExit) as stop:
            igcli.main(["--dataset", str(csv), "--out", str(tmp_path / "x.parquet"), "--corrupted-column", "corrupted",
                        *extra])
        assert stop.value.code == 2
        assert "--corrupted-column needs --dataset FILE and --resolution graph" in capsys.readouterr().err
