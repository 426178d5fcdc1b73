"""Gradient estimators: agree with autograd and captum, converge at their orders."""
import numpy as np
import pytest
import torch
from captum.attr import IntegratedGradients

import iglens_core as ig
import iglens_data as igd
from conftest import random_trace, tiny_model

GRADIENT = [e for e in ig.ESTIMATORS if e != "prediction_aware"]


def _autograd_segment(readout, start, end, target, estimator, steps):
    """Independent quadrature of <end - start, grad f> with autograd, one point at a time."""
    alphas, weights = ig.quadrature(estimator, steps)
    total = 0.0
    for alpha, weight in zip(alphas.tolist(), weights.tolist()):
        x = (start + alpha * (end - start)).clone().requires_grad_(True)
        with torch.enable_grad():
            f = torch.softmax(readout.logits(x[None]), -1)[0, target]
            (grad,) = torch.autograd.grad(f, x)
        total += weight * float((grad * (end - start)).sum())
    return total


@pytest.mark.parametrize("estimator", GRADIENT)
def test_batched_equals_per_token_autograd_loop(estimator):
    model = tiny_model("llama")
    trace = random_trace(model, length=9, prompt_len=6)
    readout = ig.Readout(model)
    a = ig.ig_lens(model, trace, layers=[1, 3], steps=3, estimator=estimator)
    nodes = [trace.hidden[0], trace.hidden[1], trace.hidden[3]]
    for t in range(len(trace.targets)):
        for j in range(2):
            expected = _autograd_segment(readout, nodes[j][t], nodes[j + 1][t],
                                         int(trace.targets[t]), estimator, 3)
            assert abs(float(a.values[t, j]) - expected) < 1e-6


@pytest.mark.parametrize("estimator,method", [("riemann_mid", "riemann_middle"),
                                              ("trapezoid", "riemann_trapezoid"),
                                              ("gauss_legendre", "gausslegendre")])
def test_matches_captum_integrated_gradients(estimator, method):
    model = tiny_model("gpt2")
    trace = random_trace(model)
    readout = ig.Readout(model)
    start, end = trace.hidden[1], trace.hidden[2]
    targets = trace.targets

    def forward(x):
        n_rep = x.shape[0] // len(targets)
        ids = targets.repeat(n_rep)
        return torch.softmax(readout.logits(x), -1)[torch.arange(len(x)), ids]

    attributions = IntegratedGradients(forward).attribute(end, baselines=start, n_steps=12,
                                                          method=method)
    expected = attributions.sum(-1).float()
    steps = 12
    if estimator == "trapezoid":
        # captum 0.9's trapezoid puts n points on linspace(0, 1, n) (spacing 1/(n-1)) but weights
        # them 1/n, so its weights sum to (n-1)/n; ours is the textbook rule with m = n-1 intervals
        steps, expected = 11, expected * 12 / 11
    a = ig.ig_lens(model, trace, layers=[1, 2, 3], steps=steps, estimator=estimator)
    torch.testing.assert_close(a.values[:, 1], expected, atol=2e-6, rtol=1e-4)


def test_convergence_orders():
    model = tiny_model("llama", dtype=torch.float64)
    trace = random_trace(model)
    exact = ig.ig_lens(model, trace, layers=[2, 3]).values
    def error(estimator, steps):
        return float((ig.ig_lens(model, trace, layers=[2, 3], steps=steps,
                                 estimator=estimator).values - exact).abs().max())
    ratios = [error("riemann_mid", m) / error("riemann_mid", 2 * m) for m in (16, 32)]
    assert all(3.0 < r < 5.0 for r in ratios), ratios  # second order: 4x per doubling
    assert error("riemann_left", 32) / error("riemann_left", 64) == pytest.approx(2.0, rel=0.25)
    assert error("gauss_legendre", 8) < 0.01 * error("riemann_mid", 8)


def test_quadrature_weights_sum_to_one():
    for estimator in GRADIENT:
        for steps in (1, 5):
            alphas, weights = ig.quadrature(estimator, steps)
            assert abs(float(weights.sum()) - 1.0) < 1e-12
            assert 0.0 <= float(alphas.min()) and float(alphas.max()) <= 1.0
    nodes, _ = np.polynomial.legendre.leggauss(3)
    assert np.allclose(ig.quadrature("gauss_legendre", 3)[0].numpy(), (nodes + 1) / 2)


def test_float32_estimators_match_float64_on_the_packaged_model(packaged):
    """float32 gradient estimators and profile stay near float64 where f jumps (V = 49152).

    The reference reads out every point on its own in float64 (no node products). A float32
    einsum over the vocabulary, used here before, was off by 6e-4.
    """
    import copy
    model, tokenizer = packaged
    ids, prompt_len = igd.encode(tokenizer, "What is the capital of Vietnam?",
                                "The capital of Vietnam is Hanoi.")
    trace = ig.collect(model, ids, prompt_len)
    model64 = copy.deepcopy(model).double()
    trace64 = ig.Trace(trace.input_ids, trace.prompt_len, trace.targets, trace.positions,
                       trace.hidden.double(), trace.model_probs.double())
    reference = ig.Readout(model64)
    reference.norm_kind = None  # every point through the model's own norm and head
    layers = [10, 20, 27, 28, 29, 30]
    for estimator, steps, profile in [("riemann_mid", 4, False), ("gauss_legendre", 3, False),
                                      ("prediction_aware", 8, True)]:
        ours = ig.ig_lens(model, trace, layers=layers, estimator=estimator, steps=steps, profile=profile)
        exact = ig.ig_lens(model64, trace64, layers=layers, estimator=estimator, steps=steps,
                           profile=profile, readout=reference)
        torch.testing.assert_close(ours.values.double(), exact.values, atol=2e-5, rtol=0)
        if profile:
            torch.testing.assert_close(ours.profile.double(), exact.profile, atol=2e-5, rtol=0)
