"""Parity on every supported architecture: tiny random models with randomised norm weights.

For each architecture: the readout at the last node is the model's own probability, the
attributions at layer and sublayer resolution sum to Δp (and a gradient estimator agrees with the
prediction-aware values, which exercises the closed-form path through each norm form), the
sublayer split point is where the MLP's output is added, and the logit lens at node L is the
probability of the model cut after block L. An unknown architecture gets a clear error.
"""
import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import iglens_core as ig
from conftest import ARCHS, MORE_ARCHS, random_trace, tiny_model

ALL_ARCHS = ARCHS + MORE_ARCHS


@pytest.fixture(scope="module", params=ALL_ARCHS)
def case(request):
    model = tiny_model(request.param, seed=ALL_ARCHS.index(request.param))
    trace = random_trace(model, seed=1, sublayer=True)
    with torch.no_grad():
        logits = model(trace.input_ids).logits[0].double()
    probs = torch.softmax(logits, -1)[trace.positions, trace.targets]  # the model's own, float64
    return request.param, model, trace, probs


def test_final_node_is_model_probability(case):
    _, model, trace, probs = case
    readout = ig.Readout(model)
    torch.testing.assert_close(readout(trace.hidden[-1], trace.targets).double(), probs,
                               atol=1e-6, rtol=0)


def test_softcap_bites_and_is_read_out():
    for arch in ("gemma2", "gemma3"):
        model = tiny_model(arch)
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)  # logits well past the cap of 3
        trace = random_trace(model)
        readout = ig.Readout(model)
        assert readout.adapter.softcap == 3.0
        torch.testing.assert_close(readout(trace.hidden[-1], trace.targets), trace.model_probs,
                                   atol=1e-6, rtol=0)
        readout.adapter.softcap = None
        assert (readout(trace.hidden[-1], trace.targets) - trace.model_probs).abs().max() > 1e-3


@pytest.mark.parametrize("resolution", ["layer", "sublayer"])
def test_completeness(case, resolution):
    _, model, trace, probs = case
    exact = ig.ig_lens(model, trace, resolution=resolution)
    assert exact.residual <= 1e-6
    assert len(exact.labels) == trace.n_layers * (2 if resolution == "sublayer" else 1)
    # the rows sum to the model's own probability minus f(h_0), read out independently
    p_base = ig.Readout(model)(trace.hidden[0], trace.targets).double()
    torch.testing.assert_close(exact.values.double().sum(-1), probs - p_base, atol=1e-6, rtol=0)
    # a gradient estimator integrates <delta, grad f> in closed form through this norm form;
    # the closed form is recognised for every architecture here (no fallback warning)
    readout = ig.Readout(model)
    assert readout.norm_kind in ("rms", "layer")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not behave as")
        gradient = ig.ig_lens(model, trace, resolution=resolution, estimator="gauss_legendre",
                              steps=24, readout=readout)
    torch.testing.assert_close(gradient.values, exact.values, atol=1e-5, rtol=0)


def test_sublayer_split_is_where_the_mlp_output_is_added(case):
    _, model, trace, _ = case
    adapter = ig.get_adapter(model)
    outputs = {}
    hooks = []
    for layer, block in enumerate(adapter.blocks):
        # the MLP's contribution to the residual: after Gemma's post-feedforward norm
        last = getattr(block, "post_feedforward_layernorm", None) or block.mlp
        hooks.append(last.register_forward_hook(
            lambda mod, args, out, layer=layer: outputs.__setitem__(layer, out[0, trace.positions])))
    try:
        with torch.no_grad():
            model(trace.input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    for layer in range(trace.n_layers):
        torch.testing.assert_close(trace.hidden[layer + 1] - trace.mid[layer], outputs[layer],
                                   atol=1e-5, rtol=1e-5)


def _cut_after(model, n_blocks: int):
    """A copy of ``model`` that keeps its first ``n_blocks`` blocks (its final norm and head stay)."""
    cut = copy.deepcopy(model)
    base = cut.base_model
    name = next(name for name in ("layers", "h") if isinstance(getattr(base, name, None), nn.ModuleList))
    setattr(base, name, nn.ModuleList(list(getattr(base, name))[:n_blocks]))
    config = cut.config
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, n_blocks)
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_blocks]
    return cut


def test_logit_lens_is_the_truncated_model(case):
    _, model, trace, probs = case
    attribution = ig.ig_lens(model, trace)
    n = trace.n_layers
    for layer in range(1, n + 1):
        cut = _cut_after(model, layer)
        assert ig.get_adapter(cut).n_layers == layer
        with torch.no_grad():
            logits = cut(trace.input_ids).logits[0].double()
        expected = torch.softmax(logits, -1)[trace.positions, trace.targets]
        torch.testing.assert_close(attribution.lens[:, layer].double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(attribution.lens[:, n].double(), probs, atol=1e-6, rtol=0)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix, self.ff = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.ff(self.mix(x)))


class _Custom(nn.Module):
    """A causal LM with none of the known attribute names (and no config)."""

    def __init__(self, vocab=50, d=16, n=3, blocks="stack"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks_name = blocks
        setattr(self, blocks, nn.ModuleList(_Block(d) for _ in range(n)))
        self.final = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            self.final.weight.add_(0.5 * torch.randn(d))
            self.final.bias.add_(0.1 * torch.randn(d))
        self.eval()  # IG-Lens refuses a model in training mode

    def forward(self, input_ids, **kwargs):
        h = self.embed(input_ids)
        h = h + h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[:, None]  # some token mixing
        for block in getattr(self, self.blocks_name):
            h = block(h)
        return SimpleNamespace(logits=self.out(self.final(h)))


def test_unknown_architecture_error_and_parts_by_hand():
    model = _Custom()
    with pytest.raises(ValueError) as error:
        ig.get_adapter(model)
    message = str(error.value)
    for needed in ("_Custom", "the blocks", ".layers", "the final norm", ".ln_f",
                   "the unembedding head", "get_output_embeddings()", "blocks=", "norm=", "head=",
                   "ig.Readout(model, norm="):
        assert needed in message, (needed, message)
    with pytest.raises(ValueError, match="cannot find the blocks"):
        ig.Readout(model, norm=model.final, head=model.out)  # still missing: the blocks
    ig.get_adapter(model, blocks=model.stack, norm=model.final, head=model.out)
    _check_parity(model)
    # blocks at a known name: the norm and head given to a Readout are enough, and remembered
    model = _Custom(blocks="layers")
    with pytest.raises(ValueError, match=r"cannot find the final norm .*; the unembedding head"):
        ig.collect(model, torch.zeros(1, 5, dtype=torch.long), 2)
    ig.Readout(model, norm=model.final, head=model.out)
    _check_parity(model)


def _check_parity(model):
    ids = torch.randint(0, 50, (1, 10), generator=torch.Generator().manual_seed(3))
    trace = ig.collect(model, ids, 4)  # finds the remembered parts
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[0].double(), -1)[trace.positions, trace.targets]
    attribution = ig.ig_lens(model, trace, estimator="gauss_legendre", steps=16)
    torch.testing.assert_close(attribution.p_final.double(), probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(attribution.values.sum(-1), attribution.delta_p, atol=1e-5, rtol=0)
