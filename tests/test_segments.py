"""Readout.along_segments: f and df/dalpha on every segment from one head product per path node.

The factorised path (norm = per-point scale x linear map + constant) is compared with the direct
readout of explicitly interpolated points and with autograd, on random points, random alphas and
randomised norm weights and biases.
"""
import pytest
import torch
from torch import nn

import iglens_core as ig
from conftest import ARCHS, tiny_model


def _random_path(readout, K=4, T=5, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    nodes = torch.randn(K + 1, T, readout.hidden_size, generator=gen, dtype=torch.float64).cumsum(0)
    targets = torch.randint(readout.vocab_size, (T,), generator=gen)
    alphas = torch.rand(6, generator=gen, dtype=torch.float64)
    alphas[:2] = torch.tensor([0.0, 1.0])
    return nodes.to(dtype), targets, alphas


def _interpolated(nodes, alphas):
    starts, deltas = nodes[:-1], nodes[1:] - nodes[:-1]  # (K, T, d)
    points = starts[:, :, None] + alphas.to(nodes)[None, None, :, None] * deltas[:, :, None]
    return points, deltas[:, :, None].expand_as(points)  # (K, T, m', d) each


def _autograd_slopes(readout, points, directions, targets):
    x = points.reshape(-1, points.shape[-1]).clone().requires_grad_(True)
    ids = targets[None, :, None].expand(points.shape[:-1]).reshape(-1)
    with torch.enable_grad():
        f = torch.softmax(readout.logits(x), -1)[torch.arange(len(x)), ids]
        (grad,) = torch.autograd.grad(f.sum(), x)
    return (grad * directions.reshape(x.shape)).sum(-1).reshape(points.shape[:-1])


@pytest.mark.parametrize("arch", ARCHS)
def test_factorised_values_and_slopes_match_direct_and_autograd(arch):
    model = tiny_model(arch, seed=3)
    readout = ig.Readout(model)
    assert readout.norm_kind in ("rms", "layer")  # every tested architecture takes the fast path
    nodes, targets, alphas = _random_path(readout, seed=ARCHS.index(arch))
    points, directions = _interpolated(nodes, alphas)
    f, lens = readout.along_segments(nodes, targets, alphas)
    torch.testing.assert_close(f, readout(points, targets[None, :, None]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lens, readout(nodes, targets[None]), atol=1e-7, rtol=1e-6)
    slopes, lens = readout.along_segments(nodes, targets, alphas, slope=True)
    torch.testing.assert_close(slopes, _autograd_slopes(readout, points, directions, targets),
                               atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(lens, readout(nodes, targets[None]), atol=1e-7, rtol=1e-6)
    assert readout.norm_kind is not None  # the first-call check kept the fast path


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_float64_agrees_to_the_models_precision(arch):
    model = tiny_model(arch, seed=1, dtype=torch.float64)
    readout = ig.Readout(model)
    nodes, targets, alphas = _random_path(readout, dtype=torch.float64)
    points, directions = _interpolated(nodes, alphas)
    f, _ = readout.along_segments(nodes, targets, alphas)
    assert f.dtype == torch.float64
    # Llama's and Gemma's RMSNorm compute in float32 even for a float64 model (LayerNorm does not)
    atol = 1e-12 if arch == "gpt2" else 1e-7
    torch.testing.assert_close(f, readout(points, targets[None, :, None]), atol=atol, rtol=0)
    slopes, _ = readout.along_segments(nodes, targets, alphas, slope=True)
    torch.testing.assert_close(slopes, _autograd_slopes(readout, points, directions, targets),
                               atol=100 * atol, rtol=0)


def test_head_bias_and_layernorm_bias_enter_the_offset():
    model = tiny_model("gpt2", seed=2)
    gen = torch.Generator().manual_seed(5)
    head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.copy_(torch.randn(head.bias.shape, generator=gen))
        model.transformer.ln_f.bias.copy_(torch.randn(model.config.n_embd, generator=gen))
    readout = ig.Readout(model, head=head)
    nodes, targets, alphas = _random_path(readout)
    points, _ = _interpolated(nodes, alphas)
    torch.testing.assert_close(readout.along_segments(nodes, targets, alphas)[0],
                               readout(points, targets[None, :, None]), atol=1e-6, rtol=1e-5)
    assert readout.norm_kind == "layer"  # not a silent fallback to the per-point readout


@pytest.mark.parametrize("budget", [1, 4 * 97 * 4 * 7])
def test_blocks_and_node_groups_change_nothing(budget):
    """One token and one node per product (budget 1), and an uneven split, equal one big chunk."""
    model = tiny_model("llama32")
    big, small = ig.Readout(model), ig.Readout(model, memory_budget=budget)
    nodes, targets, alphas = _random_path(big, K=7, T=9)
    for slope in (False, True):
        torch.testing.assert_close(small.along_segments(nodes, targets, alphas, slope=slope),
                                   big.along_segments(nodes, targets, alphas, slope=slope),
                                   atol=1e-7, rtol=1e-6)


class OddRMSNorm(nn.Module):
    """Called an RMSNorm, but not of the form s(h) A h + b (a tanh inside)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = 1e-6

    def forward(self, h):
        h = torch.tanh(h)
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_a_norm_of_another_form_falls_back_with_a_warning():
    model = tiny_model("llama")
    odd = OddRMSNorm(model.config.hidden_size)
    readout = ig.Readout(model, norm=odd)
    assert readout.norm_kind == "rms"  # recognised by name ...
    nodes, targets, alphas = _random_path(readout)
    points, directions = _interpolated(nodes, alphas)
    with pytest.warns(UserWarning, match="does not behave as"):
        f, _ = readout.along_segments(nodes, targets, alphas)
    assert readout.norm_kind is None  # ... and dropped by the first-call check
    torch.testing.assert_close(f, readout(points, targets[None, :, None]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(readout.along_segments(nodes, targets, alphas, slope=True)[0],
                               _autograd_slopes(readout, points, directions, targets),
                               atol=1e-6, rtol=1e-4)


def test_profile_interior_points_use_the_same_values():
    model = tiny_model("gemma3", seed=4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=gen)
    trace = ig.collect(model, ids, 4)
    a = ig.ig_lens(model, trace, layers=[2, 3], steps=6, profile=True)
    nodes = torch.stack([trace.hidden[0], trace.hidden[2], trace.hidden[3]])
    points, _ = _interpolated(nodes, torch.arange(7, dtype=torch.float64) / 6)
    expected = ig.Readout(model)(points, trace.targets[None, :, None]).permute(1, 0, 2)  # (T, K, m+1)
    torch.testing.assert_close(a.profile, expected, atol=1e-6, rtol=1e-5)
