"""Readouts beyond p(y) (issue 21): log p(y), and with a foil p(y) - p(foil) and
log p(y) - log p(foil) = z_y - z_foil. Every quantity's terms add up to its change, its final value
is the model's own, and its closed-form slopes and gradient sums match autograd."""
import pytest
import torch

import iglens_core as ig
from conftest import sharp_model

ARCHS = ["llama", "gpt2", "gemma3", "qwen2"]
READOUTS = [("prob", False), ("logprob", False), ("prob", True), ("logprob", True)]


def foils_for(trace, seed=0):
    """(T,) random foil ids, never the target."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 97
    shift = torch.randint(1, vocab, trace.targets.shape, generator=gen)
    return (trace.targets + shift) % vocab


def own_quantity(model, trace, quantity, foils):
    """(T,) the quantity from the model's own logits, computed here."""
    with torch.no_grad():
        logits = model(trace.input_ids, use_cache=False).logits[0, trace.positions].double()
    logp = torch.log_softmax(logits, -1)
    rows = torch.arange(len(trace.targets))
    if foils is None:
        picked = logp[rows, trace.targets]
        return picked.exp() if quantity == "prob" else picked
    if quantity == "logprob":  # the logit difference, straight from the logits
        return logits[rows, trace.targets] - logits[rows, foils]
    return logp[rows, trace.targets].exp() - logp[rows, foils].exp()


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    torch.set_grad_enabled(False)
    model = sharp_model(request.param, seed=ARCHS.index(request.param), scale=4.0)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    return request.param, model, ig.collect_components(model, ids, 5)


@pytest.mark.parametrize("quantity, with_foil", READOUTS)
def test_terms_add_up_and_final_value_is_the_models(case, quantity, with_foil):
    arch, model, trace = case
    foils = foils_for(trace) if with_foil else None
    expected = own_quantity(model, trace, quantity, foils)
    for resolution in ("layer", "sublayer"):
        result = ig.ig_lens(model, trace, quantity=quantity, foil=foils, resolution=resolution)
        assert result.quantity == quantity
        assert (result.foils is None) == (foils is None)
        torch.testing.assert_close(result.p_final.double(), expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(result.values.double().sum(-1), result.delta_p.double(), atol=1e-5, rtol=0)
        assert result.residual < 1e-5
    # the gradient estimators (closed-form slopes) converge to the same terms
    gauss = ig.ig_lens(model, trace, quantity=quantity, foil=foils, estimator="gauss_legendre", steps=24)
    exact = ig.ig_lens(model, trace, quantity=quantity, foil=foils)
    assert float(exact.values.abs().max()) > 1e-2
    torch.testing.assert_close(gauss.values, exact.values, atol=1e-4, rtol=1e-4)
    # components: heads and neurons add up to each sublayer term of the same quantity
    parts = ig.components(model, trace, steps=32, quantity=quantity, foil=foils)
    assert parts.residual_heads < 1e-5 and parts.residual_neurons < 1e-5
    torch.testing.assert_close(parts.lens[:, -1].double(), expected, atol=2e-5, rtol=1e-5)
    observed = ig.components(model, trace, steps=1, quantity=quantity, foil=foils, estimator="prediction_aware")
    assert observed.residual_heads < 1e-5 and observed.residual_neurons < 1e-5  # exact at every m


def test_logprob_terms_add_up_to_the_answers_log_probability(case):
    arch, model, trace = case
    result = ig.ig_lens(model, trace, quantity="logprob")
    with torch.no_grad():
        logits = model(trace.input_ids, use_cache=False).logits[0].double()
    answer = torch.log_softmax(logits[trace.positions], -1)[torch.arange(len(trace.targets)), trace.targets].sum()
    torch.testing.assert_close(result.p_final.double().sum(), answer, atol=1e-4, rtol=0)
    torch.testing.assert_close(result.values.double().sum(), answer - result.p_base.double().sum(),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantity, with_foil", READOUTS)
def test_slopes_and_gradient_sums_match_autograd(case, quantity, with_foil):
    arch, model, trace = case
    foils = foils_for(trace, seed=1) if with_foil else None
    readout = ig.Readout(model)
    base = model.base_model
    norm = getattr(base, "norm", None) or base.ln_f
    cap = getattr(model.config, "final_logit_softcapping", None)
    nodes = trace.hidden[[0, 2, 3]]  # (3, T, d): two segments
    alphas = torch.tensor([0.1, 0.5, 0.8])
    weights = torch.tensor([0.2, 0.5, 0.3])

    def f_of(points):  # the quantity from the model's own final norm and head, differentiable
        logits = model.lm_head(norm(points))
        logits = torch.tanh(logits / cap) * cap if cap else logits
        logp = torch.log_softmax(logits, -1)
        pick = logp if quantity == "logprob" else logp.exp()
        value = pick.gather(-1, trace.targets[:, None])[:, 0]
        return value if foils is None else value - pick.gather(-1, foils[:, None])[:, 0]

    slopes = torch.zeros(2, len(trace.targets), len(alphas))
    sums = torch.zeros(2, len(trace.targets), nodes.shape[-1])
    with torch.enable_grad():
        for j in range(2):
            for k, (alpha, weight) in enumerate(zip(alphas, weights)):
                point = (nodes[j] + alpha * (nodes[j + 1] - nodes[j])).requires_grad_(True)
                (grad,) = torch.autograd.grad(f_of(point).sum(), point)
                slopes[j, :, k] = (grad * (nodes[j + 1] - nodes[j])).sum(-1)
                sums[j] += weight * grad
    spec = dict(foils=foils, quantity=quantity)
    got, _ = readout.along_segments(nodes, trace.targets, alphas, slope=True, **spec)
    scale = float(slopes.abs().max())
    assert scale > 1e-3
    torch.testing.assert_close(got, slopes, atol=1e-5 * scale, rtol=1e-4)
    gbar, _ = readout.along_segments(nodes, trace.targets, alphas, weights=weights, **spec)
    torch.testing.assert_close(gbar, sums, atol=1e-5 * float(sums.abs().max()), rtol=1e-4)
    points = nodes[0] + 0.3 * (nodes[1] - nodes[0])  # forward mode, point by point
    direction = nodes[1] - nodes[0]
    with torch.enable_grad():
        x = points.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(f_of(x).sum(), x)
    torch.testing.assert_close(readout.directional(points, direction, trace.targets, foils, quantity=quantity),
                               (grad * direction).sum(-1), atol=1e-5 * scale, rtol=1e-4)


def test_bad_input():
    model = sharp_model("llama", scale=4.0)
    trace = ig.collect_components(model, torch.arange(10)[None], 4)
    T = len(trace.targets)
    for call in (ig.ig_lens, ig.components):
        with pytest.raises(ValueError, match=r"quantity must be one of \('prob', 'logprob'\), got 'logit'"):
            call(model, trace, quantity="logit")
        with pytest.raises(ValueError, match=r"foil ids must lie in 0..96 .* got \[97\]"):
            call(model, trace, foil=97)
        with pytest.raises(ValueError, match=rf"shape \({T},\); got shape \({T + 1},\)"):
            call(model, trace, foil=torch.zeros(T + 1, dtype=torch.long) + 50)
        with pytest.raises(ValueError, match="foil must be integer token ids"):
            call(model, trace, foil=1.5)
        with pytest.raises(ValueError, match=r"the foil equals the target at token index\(es\) \[0\]"):
            call(model, trace, foil=int(trace.targets[0]) if T == 1 else torch.cat([trace.targets[:1], (trace.targets[1:] + 1) % 97]))
    with pytest.raises(ValueError, match="quantity must be one of"):
        ig.Readout(model)(trace.hidden, trace.targets[None], quantity="probability")
