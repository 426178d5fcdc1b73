"""Proposition 1: the segment terms sum to Δp; prediction-aware segments are endpoint differences."""
import pytest
import torch

import iglens_core as ig
import iglens_data as igd
from conftest import random_trace, tiny_model


@pytest.mark.parametrize("steps", [1, 2, 7, 64])
@pytest.mark.parametrize("baseline", ["embedding", "zero", "mean", "vector", "matrix"])
def test_sum_equals_delta_p(arch_model, steps, baseline):
    trace = random_trace(arch_model)
    gen = torch.Generator().manual_seed(steps)
    if baseline == "vector":
        baseline = torch.randn(trace.hidden.shape[-1], generator=gen)
    elif baseline == "matrix":
        baseline = torch.randn(trace.hidden.shape[1:], generator=gen)
    for layers in (None, [2], [1, 3]):
        a = ig.ig_lens(arch_model, trace, layers=layers, baseline=baseline, steps=steps,
                       profile=steps < 10)
        torch.testing.assert_close(a.values.sum(-1), a.p_final - a.p_base, atol=1e-6, rtol=0)
        assert a.residual < 1e-6
        torch.testing.assert_close(a.p_final, trace.model_probs, atol=1e-6, rtol=1e-5)


def test_segments_equal_lens_differences_and_profile_nodes():
    model = tiny_model("gemma3")
    trace = random_trace(model)
    lens = ig.logit_lens(model, trace)
    a = ig.ig_lens(model, trace, layers=[1, 3], steps=5, profile=True)
    torch.testing.assert_close(a.lens, lens[:, [0, 1, 3]], atol=1e-7, rtol=0)
    torch.testing.assert_close(a.values, a.lens[:, 1:] - a.lens[:, :-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(a.profile[..., 0], a.lens[:, :-1], atol=0, rtol=0)
    torch.testing.assert_close(a.profile[..., -1], a.lens[:, 1:], atol=0, rtol=0)
    # an interior profile point is f at the interpolated point, read out independently
    alpha = 2 / 5
    point = trace.hidden[1] + alpha * (trace.hidden[3] - trace.hidden[1])
    torch.testing.assert_close(a.profile[:, 1, 2], ig.Readout(model)(point, trace.targets),
                               atol=1e-6, rtol=0)


def test_sublayer_resolution_sums_to_delta_p(arch_model):
    trace = random_trace(arch_model, sublayer=True)
    a = ig.ig_lens(arch_model, trace, resolution="sublayer")
    n = trace.n_layers
    assert a.labels[:2] == ["L1.attn", "L1.mlp"] and len(a.labels) == 2 * n
    assert a.residual < 1e-6


def test_onset_is_first_half_crossing():
    model = tiny_model("llama")
    trace = random_trace(model)
    a = ig.ig_lens(model, trace)
    onset = a.onset(0.5)
    cumulative = a.values.cumsum(-1)
    for t in range(len(onset)):
        goal = 0.5 * a.delta_p[t]
        hits = [j for j in range(len(a.layers))
                if (cumulative[t, j] >= goal - 1e-6 if goal >= 0 else cumulative[t, j] <= goal + 1e-6)]
        assert onset[t] == a.layers[hits[0]]


def test_packaged_model_completeness(packaged):
    model, tokenizer = packaged
    ids, prompt_len = igd.encode(tokenizer, "What is the capital of Vietnam?",
                                "The capital of Vietnam is Hanoi.")
    trace = ig.collect(model, ids, prompt_len)
    for steps in (1, 16):
        a = ig.ig_lens(model, trace, steps=steps, profile=True)
        assert a.residual < 1e-6
