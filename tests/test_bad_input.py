"""Every bad input raises a ValueError that names the value and the valid range."""
import copy

import numpy as np
import pytest
import torch

import iglens_baselines as igb
import iglens_causal as igc
import iglens_core as ig
import iglens_data as igd
import iglens_plot as igp
from conftest import random_trace, tiny_model


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    return model, random_trace(model)


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_steps(setup, steps):
    with pytest.raises(ValueError, match=r"steps must be an integer >= 1, got"):
        ig.ig_lens(*setup, steps=steps)


@pytest.mark.parametrize("layers,match", [([2, 1], "strictly increasing"), ([1, 1], "strictly increasing"),
                                          ([0, 2], r"1\.\.3.*\[0\]"), ([4], r"1\.\.3.*\[4\]"),
                                          ([], "at least one")])
def test_layers(setup, layers, match):
    with pytest.raises(ValueError, match=match):
        ig.ig_lens(*setup, layers=layers)


def test_estimator_and_baseline(setup):
    with pytest.raises(ValueError, match=r"estimator must be one of .*'simpson'"):
        ig.ig_lens(*setup, estimator="simpson")
    with pytest.raises(ValueError, match=r"baseline must be one of .*'ones'"):
        ig.ig_lens(*setup, baseline="ones")
    with pytest.raises(ValueError, match=r"shape \(32,\) or \(7, 32\), got \(5,\)"):
        ig.ig_lens(*setup, baseline=torch.zeros(5))


def test_prompt_len_and_context():
    model = tiny_model("gpt2")
    ids = torch.randint(0, 97, (1, 6))
    for bad in (0, 6):
        with pytest.raises(ValueError, match=rf"prompt_len must be in 1\.\.5.*got {bad}"):
            ig.collect(model, ids, bad)
    with pytest.raises(ValueError, match="longer than the model's context of 64"):
        ig.collect(model, torch.randint(0, 97, (1, 65)), 3)


def test_nan_hidden_states():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        random_trace(model)
    trace = random_trace(tiny_model("llama"))
    trace.hidden[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ig.ig_lens(model, trace)


def test_empty_prompt_and_answer(packaged):
    _, tokenizer = packaged
    with pytest.raises(ValueError, match="prompt must be a non-empty string"):
        igd.encode(tokenizer, "  ", "x")
    with pytest.raises(ValueError, match="answer must be a non-empty string"):
        igd.encode(tokenizer, "Hi?", "")


def test_unknown_architecture():
    class Bare(torch.nn.Module):
        config = None
        def get_output_embeddings(self):
            return None
    with pytest.raises(ValueError, match=r"cannot find the blocks .*Pass the missing parts by hand"):
        ig.get_adapter(Bare().eval())


def test_unavailable_model_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'no-such/model-xyz' is not available offline"):
        ig.load_model("no-such/model-xyz")



def test_token_ids_outside_the_vocabulary_and_float_ids():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"token ids must lie in 0\.\.96.*\[97\]"):
        ig.collect(model, torch.tensor([[1, 2, 97, 3]]), 2)
    with pytest.raises(ValueError, match=r"0\.\.96.*\[-1\]"):
        igd.collect_batch(model, [(torch.tensor([1, -1, 3]), 1)])
    with pytest.raises(ValueError, match=r"integer token ids, got dtype torch.float32"):
        ig.collect(model, torch.tensor([[1.0, 2.0, 3.0]]), 1)


def test_trace_from_another_model(setup):
    model, trace = setup
    other = tiny_model("gpt2")  # 3 blocks as well, but another model: check by layers and width
    deeper = ig.collect(tiny_model("llama"), torch.randint(0, 97, (1, 6)), 3)
    deeper.hidden = torch.cat([deeper.hidden, deeper.hidden[-1:]])  # 4 blocks' worth
    with pytest.raises(ValueError, match=r"hidden of shape \(5, 3, 32\) but the model has 3 blocks"):
        ig.ig_lens(other, deeper)
    narrow = ig.Trace(trace.input_ids, trace.prompt_len, trace.targets, trace.positions,
                      trace.hidden[..., :16], trace.model_probs)
    with pytest.raises(ValueError, match=r"hidden size 32"):
        ig.ig_lens(model, narrow)
    bad_targets = ig.Trace(trace.input_ids, trace.prompt_len, trace.targets + 97, trace.positions,
                           trace.hidden, trace.model_probs)
    with pytest.raises(ValueError, match=r"targets must lie in 0\.\.96"):
        ig.ig_lens(model, bad_targets)


@pytest.mark.parametrize("estimator,profile", [("riemann_mid", False), ("gauss_legendre", False),
                                               ("prediction_aware", True)])
def test_steps_too_large_for_the_memory_budget(setup, estimator, profile):
    model, trace = setup
    readout = ig.Readout(model, memory_budget=97 * 16 * 100)  # 100 grid rows
    with pytest.raises(ValueError, match=r"steps=1000000000 .* steps must lie in 1\.\.100"):
        ig.ig_lens(model, trace, steps=10**9, estimator=estimator, profile=profile, readout=readout)
    ig.ig_lens(model, trace, steps=100, estimator=estimator, profile=profile, readout=readout)  # fits
    ig.ig_lens(model, trace, steps=10**9, readout=readout)  # the exact map reads only the nodes


def test_empty_model_name():
    for name in ("", "  "):
        with pytest.raises(ValueError, match=r"model name must be a packaged name .* got"):
            ig.load_model(name)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_baseline(setup, bad):
    baseline = torch.zeros(32)
    baseline[3] = bad
    with pytest.raises(ValueError, match=r"baseline tensor must be finite, got 1 NaN or inf"):
        ig.ig_lens(*setup, baseline=baseline)


@pytest.mark.parametrize("layers", [["5"], [1.0, 2.0], "12", [True]])
def test_layers_must_be_integers(setup, layers):
    with pytest.raises(ValueError, match=r"layers must be .*integers in 1\.\.3, got"):
        ig.ig_lens(*setup, layers=layers)


def test_heatmap_token_count(setup):
    import matplotlib
    matplotlib.use("Agg")
    attribution = ig.ig_lens(*setup)
    with pytest.raises(ValueError, match=r"one label per target token \(7\), got 2"):
        igp.plot_heatmap(attribution, ["a", "b"])


def test_bad_dataset(tmp_path, setup):
    model, _ = setup
    with pytest.raises(ValueError, match=r"needs a prompt column 'prompt' .*got columns \['question'\]"):
        igd.attribute_dataset(model, None, {"question": ["Hi?"]})
    with pytest.raises(ValueError, match=r"ids must be unique, these repeat: \['a'\]"):
        igd.attribute_dataset(model, None, {"id": ["a", "a"], "prompt": ["x", "y"]})
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
        igd.attribute_dataset(model, None, {"prompt": ["x"]}, batch_size=0)
    with pytest.raises(ValueError, match=r"resume=True needs out="):
        igd.attribute_dataset(model, None, {"prompt": ["x"]}, resume=True)


# --- issue 24: a name where a model belongs, non-integer prompt_len, encode types, budgets,
# --- traces and readouts of another model, patching below the gap, models on the meta device

def test_model_name_where_a_model_belongs(setup):
    model, trace = setup
    match = r"model must be a loaded torch model.*'smollm2-135m-instruct'.*ig\.load_model"
    with pytest.raises(ValueError, match=match):
        ig.collect("smollm2-135m-instruct", trace.input_ids, 5)
    with pytest.raises(ValueError, match=match):
        ig.ig_lens("smollm2-135m-instruct", trace)
    with pytest.raises(ValueError, match=match):
        igc.ablation_effects("smollm2-135m-instruct", trace)
    with pytest.raises(ValueError, match=r"model must be a loaded torch model.*got int"):
        ig.Readout(5)


@pytest.mark.parametrize("bad", [4.0, 4.5, "4", True])
def test_prompt_len_must_be_an_integer(setup, bad):
    model, trace = setup
    with pytest.raises(ValueError, match=r"prompt_len must be in 1\.\.11.*integer, got"):
        ig.collect(model, trace.input_ids, bad)
    with pytest.raises(ValueError, match=r"prompt_len must be in 1\.\.11.*integer, got"):
        igd.collect_batch(model, [(trace.input_ids, bad)])


def test_encode_types(packaged):
    _, tokenizer = packaged
    with pytest.raises(ValueError, match=r"prompt must be a non-empty string, got list \['a', 'b'\]"):
        igd.encode(tokenizer, ["a", "b"])
    with pytest.raises(ValueError, match=r"answer must be a non-empty string or None.*got 5"):
        igd.encode(tokenizer, "q", answer=5)


@pytest.mark.parametrize("budget", [0, -5, 2.5, True])
def test_memory_budget(setup, budget):
    with pytest.raises(ValueError, match=rf"memory_budget must be a positive integer number of bytes, got {budget}"):
        ig.Readout(setup[0], memory_budget=budget)


def test_trace_or_readout_of_another_model_of_the_same_sizes(setup):
    model, trace = setup
    other = tiny_model("llama", seed=1)          # same sizes, other weights
    # without the check the other model silently gives another p_final: the case is real
    unmarked = ig.Trace(**{**trace.__dict__, "model_fingerprint": None})   # built by hand: not checked
    assert not torch.allclose(ig.logit_lens(other, unmarked)[:, -1], trace.model_probs, atol=1e-3)
    match = r"the trace comes from another model.*collect it with this model"
    for call in (lambda: ig.ig_lens(other, trace), lambda: ig.logit_lens(other, trace),
                 lambda: igb.direct_logit_attribution(other, trace),
                 lambda: igc.ablation_effects(other, trace),
                 lambda: igc.activation_patching(other, trace, trace.input_ids[:, :5], min_gap=0)):
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match=r"the readout comes from another model.*Readout\(model\)"):
        ig.ig_lens(model, trace, readout=ig.Readout(other))
    parts = ig.collect_components(model, trace.input_ids, 5)
    with pytest.raises(ValueError, match=match):
        ig.components(other, parts, resolution="head")
    # the same model in float64, or a trace from collect_batch, is accepted
    double = copy.deepcopy(model).double()
    ig.ig_lens(double, trace)
    ig.ig_lens(model, igd.collect_batch(model, [(trace.input_ids, 5)])[0])
    with pytest.raises(ValueError, match=match):
        ig.ig_lens(other, igd.collect_batch(model, [(trace.input_ids, 5)])[0])


def test_patching_refuses_a_gap_below_rounding(setup):
    model, trace = setup
    clean = trace.input_ids[:, :int(trace.positions[3]) + 1]   # the clean prefix as the corruption
    with pytest.raises(ValueError, match=r"p_clean - p' = .*less than min_gap=0\.01"):
        igc.activation_patching(model, trace, clean, target=3)
    for bad in (-0.1, 1.5, "0.1"):
        with pytest.raises(ValueError, match=r"min_gap must be a probability in \[0, 1\]"):
            igc.activation_patching(model, trace, clean, target=3, min_gap=bad)


def test_meta_device(setup):
    with pytest.raises(ValueError, match=r"device='meta' gives a model without weights"):
        ig.load_model(device="meta")
    with torch.device("meta"):
        meta = type(setup[0])(setup[0].config)
    with pytest.raises(ValueError, match=r"weights are on the 'meta' device"):
        ig.collect(meta, setup[1].input_ids, 5)
    with pytest.raises(ValueError, match=r"weights are on the 'meta' device"):
        ig.ig_lens(meta, setup[1])


# --- issue 24: the command line and the dataset runner refuse bad settings before any work

@pytest.mark.parametrize("argv,match", [
    (["Hi?", "--layers", "5,,10"], r"argument --layers: expected comma-separated integers in 1\.\.n .*got '5,,10'"),
    (["Hi?", "--layers", "5.5"], r"argument --layers: expected comma-separated integers in 1\.\.n .*got '5\.5'"),
    (["Hi?", "--max-new-tokens", "0"], r"argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["Hi?", "--steps", "two"], r"argument --steps: expected an integer >= 1, got 'two'"),
    (["--dataset", "facts.csv"], r"--dataset needs --out OUT\.parquet"),
])
def test_cli_bad_arguments(argv, match, capsys):
    import re
    import iglens_cli as igcli
    with pytest.raises(SystemExit) as stop:
        igcli.main(argv)
    assert stop.value.code == 2 and re.search(match, capsys.readouterr().err)


def test_dataset_refuses_bad_out_and_baseline_before_the_run(setup, tmp_path):
    """tokenizer=None: any item that ran would fail differently, so these errors come first."""
    model, _ = setup
    items = {"prompt": ["x", "y"]}
    with pytest.raises(ValueError, match=r"out must be a \.parquet file .*got '.*x\.csv'"):
        igd.attribute_dataset(model, None, items, out=tmp_path / "x.csv")
    assert not (tmp_path / "x.csv.parts").exists()
    d = model.config.hidden_size
    for baseline, match in [(torch.zeros(d + 1), rf"must have shape \({d},\) .*got \({d + 1},\)"),
                            (torch.zeros(2, d), rf"must have shape \({d},\) .*got \(2, {d}\)"),
                            (torch.full((d,), float("nan")), "must be finite"),
                            ("median", r"baseline must be one of .*got 'median'")]:
        with pytest.raises(ValueError, match=match):
            igd.attribute_dataset(model, None, items, baseline=baseline)


# -- issue 30: nothing silently wrong, no raw errors ---------------------------------------------

def test_a_model_in_training_mode_is_refused_everywhere():
    """Dropout makes each run differ: every entry point that runs the model refuses train() mode."""
    import iglens_dpa as igdpa
    model = tiny_model("gpt2")
    assert model.config.resid_pdrop > 0  # dropout in every block
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    trace = ig.collect_components(model, ids, 4)
    model.train()
    calls = {"collect": lambda: ig.collect(model, ids, 4),
             "collect_components": lambda: ig.collect_components(model, ids, 4),
             "ig_lens": lambda: ig.ig_lens(model, trace),
             "components": lambda: ig.components(model, trace),
             "logit_lens": lambda: ig.logit_lens(model, trace),
             "activation_patching": lambda: igc.activation_patching(model, trace, ids[:, :4], min_gap=0),
             "ablation_effects": lambda: igc.ablation_effects(model, trace),
             "component_ablation": lambda: igc.component_ablation(model, trace, [[(1, 0)]]),
             "causal_trace": lambda: igc.causal_trace(model, ids, None, 5, subject=(0, 2)),
             "dpa_ablation": lambda: igdpa.dpa_ablation(model, ids, 5, {}),
             "dpa_scores": lambda: igdpa.dpa_scores(model, ids, 5, "atp"),
             "dpa_kept": lambda: igdpa.dpa_kept(model, None, ids, 5),
             "component_dla": lambda: igb.component_dla(model, trace)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"in training mode .*call model\.eval\(\)"):
            call()
    model.eval()
    ig.ig_lens(model, trace)


def test_non_finite_scores_and_traces():
    import iglens_dpa as igdpa
    with pytest.raises(ValueError, match="scores must be finite, got 2 NaN or infinite entries"):
        igdpa.dpa_order(np.array([1.0, float("nan"), float("inf"), 0.0]))
    with pytest.raises(ValueError, match="scores must be numbers .*'high'"):
        igdpa.dpa_order(["high", "low"])
    model = tiny_model("llama")
    trace = ig.collect_components(model, torch.randint(0, 97, (1, 8)), 4)
    trace.heads[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="the trace holds 1 NaN or inf entries"):
        ig.components(model, trace)
    with pytest.raises(ValueError, match="the trace holds 1 NaN or inf entries"):
        ig.ig_lens(model, trace, resolution="sublayer")  # heads too: the same check


@pytest.mark.parametrize("fractions", [[0.0, 0.5], [0.5, 0.5], [0.2, 1.5], [-0.1, 0.5]])
def test_dpa_areas_fractions(fractions):
    import iglens_dpa as igdpa
    drops = np.zeros((1, len(fractions)))
    with pytest.raises(ValueError, match=r"fractions must be a 1-D sequence of distinct values in \(0, 1\]"):
        igdpa.dpa_areas(drops, drops, fractions)


def test_sequences_longer_than_the_context_and_boolean_ids():
    """collect's message (check_sequence) for the runs that take ids themselves (GPT-2: an IndexError
    inside torch before)."""
    import iglens_dpa as igdpa
    gpt2, llama = tiny_model("gpt2"), tiny_model("llama")
    long = torch.randint(0, 97, (1, 65), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="sequence of 65 tokens is longer than the model's context of 64"):
        igc.causal_trace(gpt2, long, None, 5, subject=(0, 2))
    for call in (lambda: igdpa.dpa_ablation(llama, long, 5, {}), lambda: igdpa.dpa_scores(llama, long, 5, "atp"),
                 lambda: igdpa.dpa_kept(llama, None, long, 5)):
        with pytest.raises(ValueError, match="sequence of 65 tokens is longer than the model's context of 64"):
            call()
    flags = torch.tensor([[True, False, True, True]])
    with pytest.raises(ValueError, match="integer token ids, got dtype torch.bool"):
        igdpa.dpa_ablation(llama, flags, 5, {})
    with pytest.raises(ValueError, match="integer token ids .*torch.bool"):
        igc.causal_trace(llama, flags, None, 5, subject=(0, 2))


def test_dpa_unknown_values():
    import iglens_dpa as igdpa
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (1, 6))
    with pytest.raises(ValueError, match=r"quantity must be one of \('prob', 'logprob'\), got 'logits'"):
        igdpa.dpa_scores(model, ids, 5, "atp", quantity="logits")
    for budget in (-1, 0, "1GB", 2.5):
        with pytest.raises(ValueError, match=r"memory_budget must be a positive integer number of bytes, got"):
            igdpa.dpa_ablation(model, ids, 5, {}, memory_budget=budget)
        with pytest.raises(ValueError, match=r"memory_budget must be a positive integer number of bytes, got"):
            igdpa.dpa_scores(model, ids, 5, "exhaustive", memory_budget=budget)
    with pytest.raises(ValueError, match=r"scores\['edges'\] must be numbers"):
        igdpa.dpa_ablation(model, ids, 5, {"edges": "top heads"})


def test_components_checks_the_trace_and_steps_as_ig_lens(setup):
    model, _ = setup
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    other = tiny_model("gpt2")  # 3 blocks of width 32 as well, another MLP width
    with pytest.raises(ValueError, match="the trace comes from another model"):
        ig.components(model, ig.collect_components(other, ids, 4))
    deeper = ig.collect_components(tiny_model("llama"), ids, 4)
    deeper.hidden = torch.cat([deeper.hidden, deeper.hidden[-1:]])  # 4 blocks' worth
    with pytest.raises(ValueError, match=r"hidden of shape \(5, 4, 32\) but the model has 3 blocks"):
        ig.components(model, deeper)
    trace = ig.collect_components(model, ids, 4)
    with pytest.raises(ValueError, match=r"steps=1000000000 .* steps must lie in 1\.\."):
        ig.components(model, trace, steps=10**9)  # numpy asked for 7 TiB before
    with pytest.raises(ValueError, match=r"steps=1000000000 .* steps must lie in 1\.\..*grid read"):
        ig.components(model, trace, steps=10**9, estimator="prediction_aware")


def test_foil_given_as_text(setup):
    model, trace = setup
    with pytest.raises(ValueError, match=r"foil must be a token id, not text ' Paris': pass tokenizer\.encode"):
        ig.ig_lens(model, trace, foil=" Paris")
    parts = ig.collect_components(model, trace.input_ids, trace.prompt_len)
    with pytest.raises(ValueError, match=r"foil must be a token id, not text"):
        ig.components(model, parts, foil=" Paris")


def test_zero_dimensional_tensors_and_numpy_scalars_are_numbers():
    import iglens_dpa as igdpa
    model = tiny_model("llama")
    clean = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    target = int(model(clean).logits[0, -1].argmax())
    plain = igc.causal_trace(model, clean, None, target, subject=(1, 3), noise=0.5, seeds=[1, 2], min_gap=0.0)
    for as_tensor in (torch.tensor, np.int64, np.int32):
        same = igc.causal_trace(model, clean, None, as_tensor(target), subject=(as_tensor(1), as_tensor(3)),
                                noise=np.float32(0.5) if as_tensor is not torch.tensor else torch.tensor(0.5),
                                seeds=[as_tensor(1), as_tensor(2)], min_gap=np.float32(0.0))
        torch.testing.assert_close(same.probs, plain.probs, atol=0, rtol=0)
    assert igdpa.dpa_kept(model, None, clean, torch.tensor(target)) == igdpa.dpa_kept(model, None, clean, target)
    trace = ig.collect(model, torch.cat([clean, torch.tensor([[target]])], 1), 6)
    patched = igc.activation_patching(model, trace, clean, target=torch.tensor(0), min_gap=torch.tensor(0.0))
    torch.testing.assert_close(patched.probs, igc.activation_patching(model, trace, clean, min_gap=0).probs)
    with pytest.raises(ValueError, match=r"seeds must be a non-empty sequence of integers in -2\*\*63\.\.2\*\*64-1"):
        igc.causal_trace(model, clean, None, target, subject=(1, 3), noise=0.5, seeds=[2**70])
    with pytest.raises(ValueError, match=r"seeds must be .*got 7"):
        igc.causal_trace(model, clean, None, target, subject=(1, 3), noise=0.5, seeds=7)
    with pytest.raises(ValueError, match=r"target must be a token id in 0\.\.96, got 3\.0"):
        igc.causal_trace(model, clean, None, torch.tensor(3.0), subject=(1, 3), noise=0.5)


def test_source_route_scores_and_component_dla_name_what_to_pass(setup):
    import iglens_stats as igs
    model, trace = setup
    parts = ig.collect_components(model, trace.input_ids, trace.prompt_len, sources=True)
    result = ig.components(model, parts, resolution="source")
    with pytest.raises(ValueError, match=r"parts must be an \(n, H, S\) .*got Components: pass one token's sources"):
        igs.source_route_scores(result, np.zeros((6, 4)), 2)
    with pytest.raises(ValueError, match=r"resolution must be 'head', 'neuron' or 'source', got 'sources'"):
        igb.component_dla(model, parts, resolution="sources")


def test_more_dpa_and_tracing_values():
    import iglens_dpa as igdpa
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    for bad in ("0.1", -0.5, 1.0):
        with pytest.raises(ValueError, match=r"min_prob must be a probability in \[0, 1\), got"):
            igdpa.dpa_kept(model, None, ids, 5, min_prob=bad)
    assert igdpa.dpa_kept(model, None, ids, 5, min_prob=np.float32(0.1)) == igdpa.dpa_kept(model, None, ids, 5)
    with pytest.raises(ValueError, match="fractions must be numbers"):
        igdpa.dpa_ablation(model, ids, 5, {}, fractions=["half"])
    scores = igdpa.dpa_scores(model, ids, 5, "random", seed=torch.tensor(3))
    assert torch.equal(scores["edges"], igdpa.dpa_scores(model, ids, 5, "random", seed=3)["edges"])
    target = int(model(ids).logits[0, -1].argmax())
    kwargs = dict(subject=(1, 3), noise=0.5, seeds=[1], min_gap=0.0)
    torch.testing.assert_close(igc.causal_trace(model, ids, None, target, batch_size=torch.tensor(3), **kwargs).probs,
                               igc.causal_trace(model, ids, None, target, batch_size=3, **kwargs).probs)


# --- issue 30: input files and the command line, nothing silently wrong

def _items(path, **names):
    import iglens_tables as igt
    return igt.read_items(path, **names)


def test_csv_row_with_an_unquoted_comma(tmp_path):
    """A row with more fields than the header used to shift the columns (pandas made the first field
    the index); fewer fields used to become a silent greedy answer."""
    import re
    path = tmp_path / "facts.csv"
    path.write_text("id,prompt,answer\na,Capital of France?,Paris\n\nb,Capital of Italy, the country?,Rome\n")
    with pytest.raises(ValueError, match=re.escape(repr(str(path))) + r" is not valid CSV: line 4 has 4 fields, "
                       r"the header has 3 .*must be in double quotes"):
        _items(path)
    path.write_text('id,prompt,answer\nb,"Capital of Italy, the country?",Rome\n')
    assert _items(path)[["id", "prompt", "answer"]].values.tolist() == [["b", "Capital of Italy, the country?", "Rome"]]
    path.write_text("id,prompt,answer\na,Capital of France?\n")
    with pytest.raises(ValueError, match=r"line 2 has 2 fields, the header has 3"):
        _items(path)
    path.write_text('id,prompt\na,"unclosed\n')  # the quote runs to the end of the file
    with pytest.raises(ValueError, match=r"is not valid CSV: line 2: .*double quotes"):
        _items(path)


def test_parquet_bytes_and_token_ids(tmp_path):
    import pandas as pd
    path = tmp_path / "facts.parquet"
    pd.DataFrame({"prompt": ["The capital of France is".encode(), "Où?".encode()],
                  "answer": [b" Paris", None]}).to_parquet(path)
    table = _items(path)
    assert table["prompt"].tolist() == ["The capital of France is", "Où?"] and table["answer"].tolist() == [" Paris", None]
    pd.DataFrame({"prompt": [b"ok", b"\xff\xfe"]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"facts\.parquet', row 1, column 'prompt': bytes that are not UTF-8"):
        _items(path)
    pd.DataFrame({"prompt": [[1, 2, 3], [4, 5]]}).to_parquet(path)  # token ids, not text
    with pytest.raises(ValueError, match=r"facts\.parquet', row 0, column 'prompt': text expected, got a list "
                       r"\(\[1, 2, 3\]\); token ids are not read"):
        _items(path)


def test_jsonl_ids_as_written_and_missing_ids(tmp_path):
    path = tmp_path / "facts.jsonl"
    path.write_text('{"id": 1, "prompt": "x", "answer": "y"}\n{"id": 20, "prompt": "z"}\n'
                    '{"id": "c-3", "prompt": "w", "answer": "v"}\n')
    table = _items(path)
    assert table["id"].tolist() == ["1", "20", "c-3"] and table["answer"].tolist() == ["y", None, "v"]
    path.write_text('{"id": 1, "prompt": "x"}\n\n{"prompt": "z"}\n')
    with pytest.raises(ValueError, match=r"facts\.jsonl': 1 rows have no id in column 'id' \(the first at line 3\)"):
        _items(path)


def test_jsonl_broken_line_number(tmp_path):
    """The line of the file (1-based, blank lines counted), not 1 or the count of records."""
    path = tmp_path / "facts.jsonl"
    path.write_text('{"prompt": "a\u2028b"}\n\n{"prompt": "x"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"not valid JSON Lines: line 4, column 12: Expecting value"):
        _items(path)
    path.write_text('{"prompt": "a\u2028b"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"found list at line 3"):
        _items(path)


def test_directory_as_dataset(tmp_path):
    (tmp_path / "facts.csv").mkdir()
    with pytest.raises(ValueError, match=r"facts\.csv' is a directory"):
        _items(tmp_path / "facts.csv")


def test_duplicate_ids_name_their_lines(tmp_path):
    path = tmp_path / "facts.tsv"
    path.write_text("id\tprompt\na\tx\nb\ty\na\tz\n")
    with pytest.raises(ValueError, match=r"facts\.tsv': dataset ids must be unique, these repeat: \['a'\] "
                       r"\('a' at line 2 and line 4\)"):
        _items(path)


def test_from_frame_names_missing_columns():
    import iglens_tables as igt
    model = tiny_model("gpt2", seed=6)
    frame = ig.ig_lens(model, random_trace(model, seed=7), layers=[1, 2]).to_frame()
    with pytest.raises(ValueError, match=r"frame lacks the columns \['lens_start', 'p_base'\]"):
        igt.attribution_from_frame(frame.drop(columns=["p_base", "lens_start"]))


@pytest.mark.parametrize("make,code,match", [
    (lambda tmp: tmp / "nowhere.csv", 2, r"No such file or directory"),
    (lambda tmp: (tmp / "dir.csv").mkdir() or tmp / "dir.csv", 2, r"is a directory"),
    (lambda tmp: (tmp / "locked.csv").write_text("prompt\nx\n") and (tmp / "locked.csv").chmod(0) or tmp / "locked.csv",
     2, r"Permission denied|prompt"),  # root reads it anyway: then the run goes on to the model
])
def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, make, code, match):
    """Every expected failure: one line, ``iglens: error: ...``, exit status 2; no traceback."""
    import re
    import iglens_cli as igcli
    monkeypatch.setattr(igcli, "load_model", lambda *a, **k: (_ for _ in ()).throw(ValueError("no model here")))
    got = igcli.main(["--dataset", str(make(tmp_path)), "--out", str(tmp_path / "r.parquet")])
    err = capsys.readouterr().err
    assert got == code and err.startswith("iglens: error: ") and err.count("\n") == 1, err
    assert re.search(match, err) or "no model here" in err, err


def test_cli_unexpected_errors_and_interrupts(tmp_path, capsys, monkeypatch):
    import iglens_cli as igcli
    argv = ["--dataset", str(tmp_path / "x.csv"), "--out", str(tmp_path / "r.parquet")]
    monkeypatch.setattr(igcli, "load_model", lambda *a, **k: {}["missing"])  # a bug: KeyError
    assert igcli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("iglens: error: unexpected KeyError: 'missing'") and err.count("\n") == 1
    with pytest.raises(KeyError):
        igcli.main(argv + ["--debug"])
    monkeypatch.setenv("IGLENS_DEBUG", "1")
    with pytest.raises(KeyError):
        igcli.main(argv)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(igcli, "load_model", interrupted)
    with pytest.raises(KeyboardInterrupt):  # main() leaves Ctrl-C to its caller
        igcli.main(argv)
    assert igcli.command(argv) == 130  # the iglens executable: one line
    assert capsys.readouterr().err.startswith("iglens: interrupted")
    monkeypatch.setattr(igcli, "load_model", lambda *a, **k: open(tmp_path / "gone" / "weights"))  # OSError
    monkeypatch.delenv("IGLENS_DEBUG")
    assert igcli.main(["Hi?"]) == 2
    assert capsys.readouterr().err.startswith("iglens: error: [Errno 2] No such file")


def test_dpa_areas_refuses_text_drops():
    import iglens_dpa as igdpa
    fractions = [0.1, 0.5, 1.0]
    with pytest.raises(ValueError, match="disrupt drops must be numbers"):
        igdpa.dpa_areas([["a", "b", "c"]], [[0.0, 0.0, 0.0]], fractions)
