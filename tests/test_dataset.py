"""attribute_dataset: batched == per item, bad rows, resume after a kill, 2 ranks == 1, offloading."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import transformers

import iglens_core as ig
import iglens_cli as igcli
import iglens_data as igd
import iglens_tables as igt
from conftest import random_trace, tiny_model

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152  # the packaged SmolLM2 tokenizer's


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(ig.resolve_model_path(ig.DEFAULT_MODEL))


def _facts(n=6):
    facts = pd.read_csv(ROOT / "data" / "facts.csv").sample(n, random_state=1)[["id", "prompt", "answer"]]
    facts.iloc[1, 2] = None  # one greedy answer
    return facts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with the packaged tokenizer, saved as a model directory."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", seed=4, vocab_size=VOCAB).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch,estimator,baseline", [("llama", "prediction_aware", "embedding"),
                                                     ("gpt2", "riemann_mid", "mean"),
                                                     ("gemma3", "prediction_aware", "zero")])
def test_batched_equals_per_item(tokenizer, arch, estimator, baseline):
    model = tiny_model(arch, seed=5, vocab_size=VOCAB)
    facts = _facts()
    results, errors = igd.attribute_dataset(model, tokenizer, facts, layers=[2], steps=4,
                                           estimator=estimator, baseline=baseline, batch_size=4,
                                           max_new_tokens=5, progress=False)
    assert errors.empty and list(results["id"].unique()) == list(facts["id"])
    for item in facts.itertuples():
        answer = item.answer if isinstance(item.answer, str) else None
        ids, prompt_len = igd.encode(tokenizer, item.prompt, answer, model=model, max_new_tokens=5)
        want = ig.ig_lens(model, ig.collect(model, ids, prompt_len), layers=[2], steps=4,
                          estimator=estimator, baseline=baseline)
        got = results[results["id"] == item.id]
        assert list(got["token_index"].unique()) == list(range(len(want.targets)))
        assert got["token"].tolist()[::2] == [tokenizer.decode([t]) for t in want.targets.tolist()]
        torch.testing.assert_close(torch.tensor(got["value"].to_numpy()).view(-1, 2), want.values.double(),
                                   atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(got["lens_end"].to_numpy()).view(-1, 2),
                                   want.lens[:, 1:].double(), atol=2e-6, rtol=1e-5)
        with torch.no_grad():  # the model's own probabilities, independently
            own = torch.softmax(model(ids).logits[0, prompt_len - 1:-1].double(), -1)
        own = own.gather(-1, ids[0, prompt_len:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got["p_final"].to_numpy()[::2]), own, atol=2e-6, rtol=1e-5)
        assert (got["onset"].to_numpy()[::2] == want.onset().numpy()).all()
        assert abs(got["residual"].iloc[0] - want.residual) < 1e-6


def _csv(tmp_path, facts=None):
    facts = _facts(5) if facts is None else facts
    bad = pd.DataFrame(dict(id=["empty", "long", "blank_answer"],
                            prompt=["", "word " * 80, "Hello?"], answer=["x", "y", "   "]))
    path = tmp_path / "items.csv"
    pd.concat([facts.iloc[:2], bad, facts.iloc[2:]]).to_csv(path, index=False)
    return path


def _run(model_dir, csv, out, *more):
    return igcli.main(["--dataset", str(csv), "--out", str(out), "--model", str(model_dir), "--steps", "4",
                    "--layers", "1,2", "--batch-size", "2", "--max-new-tokens", "4", *more])


def test_cli_bad_rows_and_resume_after_kill(tmp_path, model_dir, monkeypatch, capsys):
    csv = _csv(tmp_path)
    assert _run(model_dir, csv, tmp_path / "whole.parquet") == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("5 items done, 3 failed, worst residual")
    whole = pd.read_parquet(tmp_path / "whole.parquet")
    errors = pd.read_parquet(tmp_path / "whole.errors.parquet").set_index("id")["error"]
    assert "prompt must be a non-empty string" in errors["empty"]
    assert "longer than the model's context of 64" in errors["long"]
    assert "answer must be a non-empty string" in errors["blank_answer"]
    assert whole["id"].nunique() == 5 and not whole.duplicated(["id", "token_index", "segment"]).any()
    assert whole["residual"].max() < 1e-6

    written = []
    real = igt.write_shard

    def dies_in_the_second_shard(frame, path):
        if path.name.endswith(".results.parquet"):
            if written:
                path.with_name(f".{path.name}.tmp").write_bytes(b"half a shard")  # killed mid-write
                raise KeyboardInterrupt("killed")
            written.append(path)
        real(frame, path)

    monkeypatch.setattr(igt, "write_shard", dies_in_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        _run(model_dir, csv, tmp_path / "killed.parquet")
    monkeypatch.setattr(igt, "write_shard", real)
    parts = tmp_path / "killed.parquet.parts"
    done = pd.read_parquet(next(parts.glob("*.results.parquet")))["id"].unique()
    assert len(done) == 2 and not (tmp_path / "killed.parquet").exists()
    capsys.readouterr()
    assert _run(model_dir, csv, tmp_path / "killed.parquet", "--resume") == 0
    assert "5 items done, 3 failed" in capsys.readouterr().out
    resumed = pd.read_parquet(tmp_path / "killed.parquet")
    pd.testing.assert_frame_equal(resumed, whole, atol=1e-6, rtol=1e-5)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "killed.errors.parquet"),
                                  pd.read_parquet(tmp_path / "whole.errors.parquet"))


def test_two_processes_equal_one(tmp_path, model_dir):
    """torchrun, 2 CPU processes (gloo): rank 0 merges; the same rows as one process."""
    csv = _csv(tmp_path, _facts(7))
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    args = ["--dataset", str(csv), "--model", str(model_dir), "--steps", "4", "--batch-size", "2",
            "--max-new-tokens", "4"]
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(ROOT / "iglens_cli.py"),
                           *args, "--out", str(tmp_path / "two.parquet")], env=env, capture_output=True,
                          text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "7 items done, 3 failed" in done.stdout
    assert len(list((tmp_path / "two.parquet.parts").glob("rank0001-*"))) > 0  # rank 1 wrote its own
    assert igcli.main([*args, "--out", str(tmp_path / "one.parquet")]) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "two.parquet"),
                                  pd.read_parquet(tmp_path / "one.parquet"), atol=1e-6, rtol=1e-5)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "two.errors.parquet"),
                                  pd.read_parquet(tmp_path / "one.errors.parquet"))


@pytest.mark.parametrize("arch,device_map", [
    ("llama", {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.rotary_emb": "cpu",
               "model.norm": "disk", "lm_head": "disk"}),
    ("gpt2", {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
              "transformer.h": "cpu", "transformer.ln_f": "disk", "lm_head": "cpu"})])
def test_readout_with_offloaded_norm_and_head(tmp_path, tokenizer, arch, device_map):
    """accelerate keeps offloaded weights on 'meta' between calls: the readout must go through
    the hooked modules (LayerNorm bias of GPT-2, the head of Llama on disk)."""
    model = tiny_model(arch, seed=6)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    offloaded, _ = ig.load_model(str(tmp_path / "model"), device_map=device_map,
                                 offload_folder=str(tmp_path / "offload"))
    weights = offloaded.lm_head.weight if arch == "llama" else offloaded.transformer.ln_f.bias
    assert weights.device.type == "meta"
    wanted = {}
    for estimator, profile in [("riemann_mid", False), ("prediction_aware", True)]:
        want = ig.ig_lens(model, random_trace(model, seed=1), estimator=estimator, steps=4, profile=profile)
        got = ig.ig_lens(offloaded, random_trace(offloaded, seed=1), estimator=estimator, steps=4,
                         profile=profile)
        torch.testing.assert_close(got.values, want.values, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.lens, want.lens, atol=1e-6, rtol=0)
        wanted[estimator] = want
    direct = ig.Readout(offloaded)
    direct.norm_kind = None  # every point on its own: forward-mode through the hooked norm
    got = ig.ig_lens(offloaded, random_trace(offloaded, seed=1), estimator="riemann_mid", steps=4,
                     readout=direct)
    torch.testing.assert_close(got.values, wanted["riemann_mid"].values, atol=1e-5, rtol=0)


def test_an_item_failing_inside_a_batch_is_isolated(tokenizer, monkeypatch):
    """A ValueError inside a batch (e.g. NaN hidden states) costs only the item that raised it."""
    model = tiny_model("llama", seed=7, vocab_size=VOCAB)
    facts = _facts(5).dropna()
    clean, _ = igd.attribute_dataset(model, tokenizer, facts, layers=[2], steps=2, progress=False)
    poisoned = igd.encode(tokenizer, facts["prompt"].iloc[1], facts["answer"].iloc[1])[0][0]
    real = igd.collect_batch

    def collect_batch(model, sequences, **kwargs):
        if any(torch.equal(torch.as_tensor(ids).flatten(), poisoned) for ids, _ in sequences):
            raise ValueError("the hidden states contain NaN or inf (poisoned)")
        return real(model, sequences, **kwargs)

    monkeypatch.setattr(igd, "collect_batch", collect_batch)
    results, errors = igd.attribute_dataset(model, tokenizer, facts, layers=[2], steps=2, progress=False)
    assert errors["id"].tolist() == [facts["id"].iloc[1]] and "poisoned" in errors["error"].iloc[0]
    pd.testing.assert_frame_equal(results, clean[clean["id"] != facts["id"].iloc[1]].reset_index(drop=True))


def test_cli_needs_exactly_one_of_prompt_and_dataset(tmp_path, capsys):
    for argv in ([], ["Hi?", "--dataset", str(tmp_path / "x.csv")]):
        with pytest.raises(SystemExit) as stop:
            igcli.main(argv)
        assert stop.value.code == 2
        assert "exactly one of a prompt or --dataset" in capsys.readouterr().err


def test_rank0_reports_shards_it_cannot_see(tmp_path, tokenizer, monkeypatch):
    """Two ranks whose shard folders differ (nodes without a shared file system): rank 0 says so."""
    model = tiny_model("llama", seed=8, vocab_size=VOCAB)
    monkeypatch.setattr(igd, "distributed_rank", lambda: (0, 2))  # the other rank wrote elsewhere
    monkeypatch.setattr(igd, "_barrier", lambda world: None)
    with pytest.raises(FileNotFoundError, match=r"2 items have no shard .* every node shares"):
        igd.attribute_dataset(model, tokenizer, _facts(6).dropna(), layers=[2], steps=2, progress=False,
                             out=tmp_path / "out.parquet")


def test_from_frame_rebuilds_the_attribution():
    model = tiny_model("gpt2", seed=6)
    attribution = ig.ig_lens(model, random_trace(model, seed=7), layers=[1, 2])
    rebuilt = igt.attribution_from_frame(attribution.to_frame())
    torch.testing.assert_close(rebuilt.values, attribution.values.double())
    torch.testing.assert_close(rebuilt.lens, attribution.lens.double())
    torch.testing.assert_close(rebuilt.delta_p, attribution.delta_p.double())
    assert rebuilt.layers == attribution.layers and rebuilt.labels == attribution.labels
    assert abs(rebuilt.residual - attribution.residual) < 1e-7
    with pytest.raises(ValueError, match="full grid"):
        igt.attribution_from_frame(attribution.to_frame().iloc[1:])
    with pytest.raises(ValueError, match="one id"):
        igt.attribution_from_frame(pd.concat([attribution.to_frame().assign(id="a"),
                                             attribution.to_frame().assign(id="b")]))


def test_cli_html_per_item(tmp_path, model_dir, capsys):
    from test_html import _figure
    facts = _facts(3)
    csv = tmp_path / "items.csv"
    facts.to_csv(csv, index=False)
    views = tmp_path / "views"
    assert _run(model_dir, csv, tmp_path / "r.parquet", "--html", str(views)) == 2  # no such folder
    assert "existing folder" in capsys.readouterr().err
    views.mkdir()
    assert _run(model_dir, csv, tmp_path / "r.parquet", "--html", str(views)) == 0
    results = pd.read_parquet(tmp_path / "r.parquet")
    assert sorted(p.name for p in views.iterdir()) == sorted([f"{i}.html" for i in facts["id"]] + ["plotly.min.js"])
    for item, rows in results.groupby("id"):
        text = (views / f"{item}.html").read_text(encoding="utf-8")
        assert re.findall(r'<script[^>]*src="([^"]+)"', text) == ["plotly.min.js"]  # local, loaded offline
        data, _ = _figure(text)
        grid = rows.sort_values(["token_index", "segment"])
        want = grid["value"].to_numpy().reshape(grid["token_index"].nunique(), -1)
        np.testing.assert_allclose(np.array(data[0]["z"], dtype=float), want, rtol=1e-6, atol=1e-9)


def _write(frame, path):
    """``frame`` as the file ``path``, its format from the extension (the writers pandas has)."""
    writers = {".csv": lambda: frame.to_csv(path, index=False),
               ".tsv": lambda: frame.to_csv(path, sep="\t", index=False),
               ".json": lambda: frame.to_json(path, orient="records", force_ascii=False),
               ".jsonl": lambda: frame.to_json(path, orient="records", lines=True, force_ascii=False),
               ".parquet": lambda: frame.to_parquet(path, index=False)}
    writers[path.suffix]()
    return path


def test_every_format_and_renamed_columns_give_the_same_results(tmp_path, tokenizer):
    """The same facts as CSV, TSV, JSON, JSON Lines and Parquet (one greedy answer, one prompt with
    a tab, a comma and a quote, a non-ASCII answer), and with renamed columns: equal results."""
    model = tiny_model("llama", seed=9, vocab_size=VOCAB)
    facts = _facts(4)
    facts.iloc[2, 1:] = ['Capital, "quoted",\tof Côte d\'Ivoire?', " Paris"]
    facts.iloc[3, 2] = "Yamoussoukro, Côte d’Ivoire"
    run = lambda items, **names: igd.attribute_dataset(model, tokenizer, items, layers=[2], steps=2,
                                                       max_new_tokens=3, progress=False, **names)
    want, errors = run(facts)
    assert errors.empty and want["id"].nunique() == 4
    for suffix in igt.DATASET_FORMATS:
        got, errors = run(_write(facts, tmp_path / f"facts{suffix}"))
        assert errors.empty, suffix
        pd.testing.assert_frame_equal(got, want, obj=suffix)
    renamed = facts.rename(columns=dict(prompt="question", answer="attribute", id="key"))
    names = dict(prompt_column="question", answer_column="attribute", id_column="key")
    for suffix in (".jsonl", ".parquet"):
        got, _ = run(_write(renamed, tmp_path / f"renamed{suffix}"), **names)
        pd.testing.assert_frame_equal(got, want, obj=suffix)


def test_unreadable_dataset_files(tmp_path):
    """Each bad file: a ValueError naming the file and what was found, before any model work."""
    def raises(name, content, match, **names):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=re.escape(repr(str(path))) + ".*" + match):
            igt.read_items(path, **names)

    good = "id,prompt,answer\na,Capital of France?,Paris\n"
    raises("facts.xlsx", good.encode(), r"unknown extension '\.xlsx', expected one of \.csv, \.tsv")
    raises("latin1.csv", "id,prompt\na,Où est Orléans?\n".encode("latin-1"),
           r"not UTF-8: byte 0xf9 at offset 13 \(e\.g\. Latin-1\)")
    raises("header.csv", b"id,prompt,answer\n", r"has no rows \(columns \['id', 'prompt', 'answer'\]\)")
    raises("empty.tsv", b"", "is empty")
    raises("empty.json", b"[]", r"has no rows")
    raises("columns.json", b'{"prompt": ["x"]}', r"list of records .* found dict")
    raises("broken.jsonl", b'{"prompt": "x"}\n{"prompt": \n', "not valid JSON Lines")
    raises("broken.parquet", b"not parquet", "not a readable parquet file")
    raises("facts.csv", good.encode(), r"needs an answer column 'attribute' \(--answer-column / "
           r"answer_column= names another\), got columns \['id', 'prompt', 'answer'\]",
           answer_column="attribute")
    raises("question.tsv", b"id\tquestion\na\tHi?\n", r"needs a prompt column 'prompt' .*\['id', 'question'\]")


def test_cli_dataset_column_flags(tmp_path, model_dir, capsys):
    path = _write(_facts(2).rename(columns=dict(prompt="question")), tmp_path / "facts.jsonl")
    assert _run(model_dir, path, tmp_path / "r.parquet") == 2
    assert "needs a prompt column 'prompt'" in capsys.readouterr().err
    assert _run(model_dir, path, tmp_path / "r.parquet", "--prompt-column", "question",
                "--quantity", "logprob") == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("2 items done, 0 failed")
    results = pd.read_parquet(tmp_path / "r.parquet")
    assert (results["quantity"] == "logprob").all() and (results["p_final"] <= 0).all()


def test_resume_refuses_other_settings(tmp_path, tokenizer):
    """Shards of one run are not mixed with another's: each difference is named, nothing is written."""
    model = tiny_model("llama", seed=10, vocab_size=VOCAB)
    facts, out = _facts(3).dropna(), tmp_path / "r.parquet"
    run = lambda model, **more: igd.attribute_dataset(
        model, tokenizer, facts, out=out, resume=True, progress=False, **{"layers": [2], "steps": 2, **more})
    first, _ = run(model)
    shards = sorted((tmp_path / "r.parquet.parts").iterdir())
    again, _ = run(model)  # the same settings: a no-op
    pd.testing.assert_frame_equal(again, first)
    n, d = model.config.num_hidden_layers, model.config.hidden_size
    cases = [(dict(layers=[1, 2]), rf"layers: \[2, {n}\] in the shards, \[1, 2, {n}\] now"),
             (dict(steps=4, estimator="riemann_mid"),
              r"estimator: 'prediction_aware' in the shards, 'riemann_mid' now; steps: 2 in the shards, 4 now"),
             (dict(baseline=torch.zeros(d)), r"baseline: 'embedding' in the shards, 'tensor sha256:"),
             (dict(chat=False), r"chat: True in the shards, False now"),
             (dict(quantity="logprob"), r"quantity: 'prob' in the shards, 'logprob' now")]
    for more, match in cases:
        with pytest.raises(ValueError, match=r"resume: the shards in .* were made with other settings .*" + match):
            run(model, **more)
    with pytest.raises(ValueError, match=r"fingerprint: the model's weights differ"):
        run(tiny_model("llama", seed=11, vocab_size=VOCAB))  # same sizes, other weights
    assert sorted((tmp_path / "r.parquet.parts").iterdir()) == shards
    (tmp_path / "r.parquet.parts" / igd.SETTINGS_FILE).unlink()  # shards of an unknown run
    with pytest.raises(ValueError, match=r"holds shards but no settings\.json"):
        run(model)


@pytest.mark.parametrize("quantity", ["prob", "logprob"])
def test_quantity_and_foils_equal_per_item(tokenizer, quantity):
    """Items with and without a foil in one batch: each equals ig_lens(quantity=, foil=) alone, and the
    f difference is the model's own; a foil of two tokens, or equal to the answer, is an error row."""
    model = tiny_model("llama", seed=12, vocab_size=VOCAB)
    facts = _facts(5).dropna().reset_index(drop=True)
    facts["foil"] = [" Lyon", None, " Paris and Lyon", "", None][:len(facts)]
    first = tokenizer.decode(igd.encode(tokenizer, facts["prompt"][3], facts["answer"][3])[0][0, -len(
        tokenizer(facts["answer"][3], add_special_tokens=False)["input_ids"])].item())
    facts.loc[3, "foil"] = first  # the answer's first token
    results, errors = igd.attribute_dataset(model, tokenizer, facts, layers=[2], steps=3, batch_size=4,
                                           quantity=quantity, progress=False)
    assert set(errors["id"]) == {facts["id"][2], facts["id"][3]}
    assert "must be one token, it tokenises to" in errors.set_index("id")["error"][facts["id"][2]]
    assert "the foil equals the target" in errors.set_index("id")["error"][facts["id"][3]]
    assert (results["quantity"] == quantity).all()
    for item in facts.drop([2, 3]).itertuples():
        ids, prompt_len = igd.encode(tokenizer, item.prompt, item.answer)
        foil = tokenizer(item.foil, add_special_tokens=False)["input_ids"][0] if item.foil else None
        want = ig.ig_lens(model, ig.collect(model, ids, prompt_len), layers=[2], steps=3,
                          quantity=quantity, foil=foil)
        got = results[results["id"] == item.id]
        assert (got["foil"].isna() if foil is None else got["foil"] == item.foil).all()
        torch.testing.assert_close(torch.tensor(got["value"].to_numpy()).view(-1, 2), want.values.double(),
                                   atol=2e-6, rtol=1e-5)
        with torch.no_grad():  # f at the last layer from the model's own logits, independently
            logp = torch.log_softmax(model(ids).logits[0, prompt_len - 1:-1].double(), -1)
        f = logp if quantity == "logprob" else logp.exp()
        own = f.gather(-1, ids[0, prompt_len:, None])[:, 0] - (f[:, foil] if foil is not None else 0)
        torch.testing.assert_close(torch.tensor(got["p_final"].to_numpy()[::2]), own, atol=2e-6, rtol=1e-5)


def test_resume_refuses_other_columns(tmp_path, tokenizer):
    """The column names are part of the run's settings: resuming with another answer column used to
    merge the answers of two columns into one table."""
    model = tiny_model("llama", seed=10, vocab_size=VOCAB)
    facts = _facts(3).dropna()
    facts["other"] = [" Lyon", " Rome", " Oslo"][:len(facts)]
    out = tmp_path / "r.parquet"
    run = lambda **names: igd.attribute_dataset(model, tokenizer, facts, out=out, resume=True, layers=[2],
                                                steps=2, progress=False, **names)
    run()
    again, _ = run(answer_column="answer")  # the column the first run read by default: the same run
    assert again["id"].nunique() == len(facts)
    with pytest.raises(ValueError, match=r"answer_column: 'answer' in the shards, 'other' now"):
        run(answer_column="other")
    with pytest.raises(ValueError, match=r"prompt_column: 'prompt' in the shards, 'other' now"):
        run(prompt_column="other")


def test_a_readout_of_another_model_fails_before_the_run(tokenizer):
    """The model and its readout are checked once, up front: a readout of another model used to turn
    every item into an error row."""
    model, other = tiny_model("llama", seed=13, vocab_size=VOCAB), tiny_model("llama", seed=14, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"the readout comes from another model"):
        igd.attribute_dataset(model, tokenizer, _facts(2).dropna(), layers=[2], steps=2, progress=False,
                              readout=ig.Readout(other))
    results, errors = igd.attribute_dataset(model, tokenizer, _facts(2).dropna(), layers=[2], steps=2,
                                            progress=False, readout=ig.Readout(model))
    assert errors.empty and len(results)
