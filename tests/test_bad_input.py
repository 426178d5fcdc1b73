"""Every bad input raises a ValueError that names the value and the valid range."""
import os

import pytest
import torch

import iglens_core as ig
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
        ig.encode(tokenizer, "  ", "x")
    with pytest.raises(ValueError, match="answer must be a non-empty string"):
        ig.encode(tokenizer, "Hi?", "")


def test_unknown_architecture():
    class Bare(torch.nn.Module):
        config = None
        def get_output_embeddings(self):
            return None
    with pytest.raises(ValueError, match=r"cannot find the blocks .*Pass the missing parts by hand"):
        ig.get_adapter(Bare())


def test_unavailable_model_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'no-such/model-xyz' is not available offline"):
        ig.load_model("no-such/model-xyz")

