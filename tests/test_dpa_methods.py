"""The scores issue 34 adds to DPA's benchmark: IG-Lens's attribution graph at every position against
an independent call of the graph (and its leaves against the model's own readout), and integrated
gradients over the component gates against a loop written out by hand through the by-hand hooks
(same rule, and a much finer one), exact where the model is linear in the gates; its adaptive
quadrature against the loop on the same panels, converging where a tiny model's gate path is rough
and on a tanh step, where the cubic rule does not."""
import math

import numpy as np
import pytest
import torch
import transformers

import iglens_dpa as igdpa
import iglens_graph as iggraph
from conftest import blocks, sharp_model, tiny_model
from test_dpa import D_FF, HEADS, prob_by_hand, zeroed_by_hand

ARCHS = ["llama", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    """A float64 tiny model (randomised norms), a random prompt and its arg-max next token."""
    torch.set_grad_enabled(False)
    model = tiny_model(request.param, seed=11 + ARCHS.index(request.param), dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    target = int(model(ids).logits[0, -1].argmax())
    return request.param, model, ids, target


def readout_by_hand(model, state, target, quantity):
    """f of one residual state (d,) through the model's own final norm, head and soft-cap."""
    logits = model.lm_head(model.model.norm(state[None, None]))[0, 0].double()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    probs = torch.softmax(logits, -1)
    return float(probs[target] if quantity == "prob" else probs.log()[target])


@pytest.mark.parametrize("quantity", ["prob", "logprob"])
def test_graph_scores_are_the_graphs_node_shares(case, quantity):
    arch, model, ids, target = case
    S = ids.shape[1]
    scores = igdpa.dpa_scores(model, ids, target, "ig_lens_graph", quantity=quantity, steps=8)
    graph = iggraph.attribution_graph(model, torch.cat([ids, torch.tensor([[target]])], 1), S, steps=8,
                                      quantity=quantity, edges=True)
    assert scores["edges"].shape == (len(blocks(model)), HEADS, S, S) and scores["neurons"].shape == (len(blocks(model)), S, D_FF)
    torch.testing.assert_close(scores["edges"], graph.edges[:, :, :S, :S].double(), rtol=0, atol=1e-12)
    torch.testing.assert_close(scores["neurons"], graph.neurons[:, :S].double(), rtol=0, atol=1e-12)
    assert float(graph.edges[:, :, S:].abs().max()) == 0 and float(graph.neurons[:, S:].abs().max()) == 0
    # every position is scored (not the last one only, as "ig_lens")
    assert float(scores["edges"][:, :, :S - 1].abs().max()) > 1e-6
    assert float(scores["neurons"][:, :S - 1].abs().max()) > 1e-6
    # the heads' edges add up to the head shares; the leaves (embeddings and constants) add up to
    # delta, which is f(h_n) - f(h_0) read out here through the model's own modules
    torch.testing.assert_close(scores["edges"].sum(-1), graph.heads[:, :, :S].double(), rtol=0, atol=1e-12)
    embedded = model(ids, output_hidden_states=True).hidden_states[0][0, -1]  # h_0 (Gemma's scale included)
    delta = (readout_by_hand(model, _last_state(model, ids), target, quantity)
             - readout_by_hand(model, embedded, target, quantity))
    assert math.isclose(graph.delta, delta, rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(float(graph.embeddings.sum()) + graph.constants, delta, rel_tol=1e-6, abs_tol=1e-9)
    # the top block's neurons carry only its own top term (nothing above reads them)
    n = len(blocks(model))
    assert math.isclose(float(scores["neurons"][n - 1].sum()) + float(graph.constants_by_block[n - 1, 1]),
                        float(graph.mlp_terms[n - 1]), rel_tol=1e-6, abs_tol=1e-12)


def _last_state(model, ids):
    """h_n at the last position: the final norm's input, by a hook found by name."""
    kept = {}
    hook = model.model.norm.register_forward_pre_hook(lambda mod, args: kept.__setitem__("h", args[0]))
    model(ids)
    hook.remove()
    return kept["h"][0, -1]


def rule_by_hand(m, panels=(0.0, 1.0)):
    """The gate path's rule written out: panel k of the edges in u gets m // K numpy Gauss-Legendre
    points (the first m % K panels one more), t = u^3, weight 3 u^2 times the panel's share.
    Returns [(t, weight)]."""
    K = len(panels) - 1
    points = []
    for k in range(K):
        low, high = panels[k], panels[k + 1]
        nodes, weights = np.polynomial.legendre.leggauss(m // K + (k < m % K))
        for x, w in zip(nodes, weights):
            u = low + (high - low) * (x + 1) / 2
            points.append((u ** 3, 3 * u ** 2 * w * (high - low) / 2))
    return points


def mask_ig_by_hand(model, ids, target, m, context=None, quantity="prob", panels=(0.0, 1.0)):
    """Integrated gradients over the gates written out on :func:`rule_by_hand`'s points, one forward
    and backward per point through the by-hand hooks (gates on the softmax output and on act_fn's
    output); gates outside the context held at 1."""
    n, S = len(blocks(model)), ids.shape[1]
    inside = torch.ones(S, dtype=torch.bool) if context is None else torch.as_tensor(context)
    vary_e, vary_n = (inside[:, None] & inside[None, :]).double(), inside[:, None].double()
    total_e, total_n = torch.zeros(n, HEADS, S, S, dtype=torch.float64), torch.zeros(n, S, D_FF, dtype=torch.float64)
    for t, weight in rule_by_hand(m, panels):
        edges = (1 + (t - 1) * vary_e).expand(n, 1, HEADS, S, S).clone().requires_grad_(True)
        neurons = (1 + (t - 1) * vary_n).expand(n, 1, S, D_FF).clone().requires_grad_(True)
        with torch.enable_grad(), zeroed_by_hand(model, edges=edges, neurons=neurons):
            logits = model(ids, use_cache=False).logits[0, -1].double()
            value = logits[target] if quantity == "logit" else torch.softmax(logits, -1)[target]
            grad_e, grad_n = torch.autograd.grad(value, (edges, neurons))
        total_e += weight * grad_e[:, 0]
        total_n += weight * grad_n[:, 0]
    return total_e * vary_e, total_n * vary_n


@pytest.mark.parametrize("bos", [False, True])
def test_mask_ig_against_a_loop_by_hand(case, bos):
    arch, model, ids, target = case
    S = ids.shape[1]
    context = np.ones(S, bool)
    context[0] = not bos
    result = igdpa.mask_ig(model, ids, target, steps=6, context=context, rule="cubic")
    assert result.rule == "cubic" and list(result.panels) == [0.0, 1.0] and result.scan_rows == 0
    edges, neurons = mask_ig_by_hand(model, ids, target, 6, context=context)
    assert float(edges.abs().max()) > 1e-5 and float(neurons.abs().max()) > 1e-5
    # transformers' eager softmax runs in float32: rows batched here and one by one there round apart
    torch.testing.assert_close(result.scores["edges"], edges, rtol=1e-5, atol=1e-6 * float(edges.abs().max()))
    torch.testing.assert_close(result.scores["neurons"], neurons, rtol=1e-5, atol=1e-6 * float(neurons.abs().max()))
    if bos:  # the BOS's components keep their gates at 1 and score 0
        assert float(result.scores["edges"][:, :, 0].abs().max()) == 0
        assert float(result.scores["edges"][:, :, :, 0].abs().max()) == 0
        assert float(result.scores["neurons"][:, 0].abs().max()) == 0
    # the ends: the model's own p (sdpa attention here), and p with every varied gate zeroed by hand
    n = len(blocks(model))
    off_e = (~torch.as_tensor(context)[:, None] | ~torch.as_tensor(context)[None, :]).double().expand(n, 1, HEADS, S, S)
    off_n = (~torch.as_tensor(context))[:, None].double().expand(n, 1, S, D_FF)
    p_on = float(torch.softmax(model(ids).logits[0, -1].double(), -1)[target])
    assert math.isclose(result.f_on, p_on, rel_tol=1e-6)
    assert math.isclose(result.f_off, prob_by_hand(model, ids, target, edges=off_e, neurons=off_n), rel_tol=1e-9)
    total = float(result.scores["edges"].sum() + result.scores["neurons"].sum())
    assert math.isclose(result.gap, total - (result.f_on - result.f_off), rel_tol=0, abs_tol=1e-15)


@pytest.mark.parametrize("rule", igdpa.MASK_RULES)
def test_mask_ig_converges_as_m_grows(case, rule):
    """The completeness gap shrinks with m and the scores approach a reference at m = 128 computed by
    the loop by hand (the cubic rule: this path is smooth)."""
    arch, model, ids, target = case
    gaps = igdpa.mask_ig_gaps(model, ids, target, steps=(3, 12, 48), rule=rule)
    assert set(gaps) == {3, 12, 48}
    assert abs(gaps[3]) > 1e-7  # the coarse rule misses: the check below can fail
    assert abs(gaps[48]) < 1e-2 * abs(gaps[3]) and abs(gaps[48]) < 1e-5
    reference = torch.cat([t.flatten() for t in mask_ig_by_hand(model, ids, target, 128)])
    ends = igdpa.mask_ig(model, ids, target, steps=1)
    assert math.isclose(float(reference.sum()), ends.f_on - ends.f_off, rel_tol=1e-6, abs_tol=1e-9)  # complete at m = 128
    errors = {}
    for m in (3, 12, 48):
        scores = igdpa.mask_ig(model, ids, target, steps=m, rule=rule).scores
        flat = torch.cat([scores["edges"].flatten(), scores["neurons"].flatten()])
        errors[m] = float((flat - reference).abs().max() / reference.abs().max())
    assert errors[48] < 1e-2 * errors[3] and errors[48] < 1e-3, errors


def one_block_llama(seed, silence):
    """A one-block float64 Llama (matrices scaled up 5x) with the final norm made the identity (a hook)
    and ``silence`` ("o_proj" or "down_proj") zeroed: its target logit is then linear in the other
    kind's gates."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
                                      num_key_value_heads=2, intermediate_size=D_FF, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    block = model.model.layers[0]
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(5.0)
        (block.self_attn.o_proj if silence == "o_proj" else block.mlp.down_proj).weight.zero_()
    model.model.norm.register_forward_hook(lambda mod, args, out: args[0])
    return model


@pytest.mark.filterwarnings("ignore:float64 model")  # the final norm, an identity by its hook, matches no norm
@pytest.mark.parametrize("silence", ["o_proj", "down_proj"])
@pytest.mark.parametrize("rule, steps", [("cubic", 2), ("adaptive", 2), ("adaptive", 9)])
def test_mask_ig_is_exact_where_the_model_is_linear_in_the_gates(silence, rule, steps):
    """With the logit linear in every gate, two points are exact (they integrate the Jacobian 3 u^2
    exactly; one point would not): the scores add up to logit(all on) - logit(all off), and each
    equals the difference made by its gate alone. The adaptive rule's estimate is exact there too
    (a central difference in t of a linear f): it keeps one panel."""
    model = one_block_llama(5, silence)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    target = int(model(ids).logits[0, -1].argmax())
    S = ids.shape[1]
    result = igdpa.mask_ig(model, ids, target, steps=steps, quantity="logit", rule=rule)
    assert result.rule == rule and list(result.panels) == [0.0, 1.0] and len(result.nodes) == steps
    total = float(result.scores["edges"].sum() + result.scores["neurons"].sum())
    assert abs(result.f_on - result.f_off) > 1e-2
    assert math.isclose(total, result.f_on - result.f_off, rel_tol=1e-10) and abs(result.gap) < 1e-10
    kind, shape = ("neurons", (1, 1, S, D_FF)) if silence == "o_proj" else ("edges", (1, 1, HEADS, S, S))
    flat = result.scores[kind].flatten()
    logit = lambda **gates: float(model_logit(model, ids, target, **gates))
    full = logit()
    for index in torch.topk(flat.abs(), 6).indices.tolist() + [int(flat.abs().argmin())]:
        gate = torch.ones(math.prod(shape), dtype=torch.float64)
        gate[index] = 0
        alone = full - logit(**{kind: gate.view(shape)})
        assert math.isclose(float(flat[index]), alone, rel_tol=1e-9, abs_tol=1e-12)


def model_logit(model, ids, target, **gates):
    with zeroed_by_hand(model, **gates):
        return model(ids, use_cache=False).logits[0, -1, target].double()


SHARP = [("llama", 40.0, 1), ("gemma3", 10.0, 1)]


@pytest.fixture(scope="module", params=SHARP, ids=[arch for arch, _, _ in SHARP])
def sharp_case(request):
    """A float64 tiny model with its matrices scaled up (conftest.sharp_model), a random prompt and its
    arg-max next token, whose gate path is rough: Llama x40's p goes up and down in narrow bumps
    (the cubic rule's gap stays ~0.3 of p(on) - p(off) up to m = 128), Gemma 3 x10's p rises by
    most of its change within t < 0.002."""
    arch, scale, seed = request.param
    torch.set_grad_enabled(False)
    model = sharp_model(arch, seed=seed, dtype=torch.float64, scale=scale)
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    return arch, model, ids, int(model(ids).logits[0, -1].argmax())


def test_adaptive_rule_against_a_loop_by_hand(sharp_case):
    """The adaptive rule's scores are the loop by hand on its own panels, and its points are the
    composite rule written out on them."""
    arch, model, ids, target = sharp_case
    result = igdpa.mask_ig(model, ids, target, steps=16)  # the default rule
    assert result.rule == "adaptive" and result.scan_rows > 0
    widths = np.diff(result.panels)
    assert len(widths) == 8 and widths.max() > 4 * widths.min()  # bisected where the path bends, not evenly
    by_hand = np.array(rule_by_hand(16, result.panels))
    np.testing.assert_allclose(np.stack([result.nodes, result.weights], 1), by_hand, rtol=1e-13, atol=0)
    edges, neurons = mask_ig_by_hand(model, ids, target, 16, panels=result.panels)
    for ours, theirs in ((result.scores["edges"], edges), (result.scores["neurons"], neurons)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6 * float(theirs.abs().max()))


def test_adaptive_rule_converges_on_a_sharp_step(sharp_case):
    """Where the gate path is rough the adaptive rule's gap shrinks with m, below the cubic rule's."""
    arch, model, ids, target = sharp_case
    gaps = {rule: igdpa.mask_ig_gaps(model, ids, target, steps=(16, 32, 64), rule=rule) for rule in igdpa.MASK_RULES}
    ends = igdpa.mask_ig(model, ids, target, steps=1)
    delta = abs(ends.f_on - ends.f_off)
    adaptive, cubic = gaps["adaptive"], gaps["cubic"]
    assert abs(cubic[64]) > 1e-6 * delta  # the step makes the cubic rule miss: the checks below can fail
    assert abs(adaptive[64]) < 1e-2 * abs(adaptive[16]) and abs(adaptive[64]) < 2e-3 * delta, gaps
    assert all(abs(adaptive[m]) < 0.1 * abs(cubic[m]) for m in (32, 64)), gaps


def test_gate_path_nodes_integrate_polynomials_in_u():
    """On random panels the composite rule integrates 3 u^2 P(u) du exactly for P of degree up to
    2 c - 3 (c: the fewest points on a panel), and matches the rule written out."""
    rng = np.random.default_rng(4)
    for K, steps in ((1, 5), (3, 7), (6, 12), (5, 23)):
        panels = np.concatenate([[0.0], np.sort(rng.uniform(0, 1, K - 1)), [1.0]])
        nodes, weights = igdpa.gate_path_nodes(panels, steps)
        np.testing.assert_allclose(np.stack([nodes, weights], 1), np.array(rule_by_hand(steps, panels)),
                                   rtol=1e-13, atol=0)
        degree = 2 * (steps // K) - 3
        for _ in range(3):
            poly = np.polynomial.Polynomial(rng.standard_normal(max(degree, 0) + 1))
            exact = (np.polynomial.Polynomial([0, 0, 3]) * poly).integ()(1.0)
            assert math.isclose(float(weights @ poly(np.cbrt(nodes))), exact, rel_tol=1e-12, abs_tol=1e-13)


def test_gate_path_panels_find_a_step():
    """On f(t) = tanh((t - t0) / w) (w = 1e-3): every round bisects only the panels that hold half
    the estimated gap, so with K = 3 the half holding the step is split again; for larger m the
    composite rule's gap (against the exact derivative) shrinks well below the cubic rule's."""
    rng = np.random.default_rng(5)
    for t0 in rng.uniform(0.2, 0.8, 3):
        counted = []

        def f(t):
            counted.append(len(t))
            return np.tanh((np.asarray(t) - t0) / 1e-3)

        def gap(panels, m):
            nodes, weights = igdpa.gate_path_nodes(panels, m)
            return float(weights @ (1 - np.tanh((nodes - t0) / 1e-3) ** 2) / 1e-3 - (f_on - f_off))

        f_off, f_on = f([0.0])[0], f([1.0])[0]
        panels, rows = igdpa.gate_path_panels(f, 6, f_off, f_on)
        half = [0.5, 0.75] if np.cbrt(t0) > 0.5 else [0.25, 0.5]
        np.testing.assert_array_equal(panels, sorted({0.0, 1.0, *half}))
        counted.clear()
        panels, rows = igdpa.gate_path_panels(f, 64, f_off, f_on)
        assert rows == sum(counted) and 8 < len(panels) - 1 <= 32  # at most m / 2 panels
        holding = np.searchsorted(panels, np.cbrt(t0)) - 1
        assert np.diff(panels)[holding] <= np.median(np.diff(panels))  # narrow where the step is
        adaptive = {m: gap(igdpa.gate_path_panels(f, m, f_off, f_on)[0], m) for m in (32, 64, 128)}
        cubic = {m: gap([0.0, 1.0], m) for m in (32, 64, 128)}
        assert abs(adaptive[128]) < 1e-2 * abs(adaptive[32]) and abs(adaptive[128]) < 1e-3, adaptive
        assert abs(adaptive[128]) < 1e-2 * abs(cubic[128]), (adaptive, cubic)


def test_mask_ig_bad_input(case):
    arch, model, ids, target = case
    with pytest.raises(ValueError, match=r"rule must be one of \('adaptive', 'cubic'\) .*got 'linear'"):
        igdpa.mask_ig(model, ids, target, rule="linear")
    with pytest.raises(ValueError, match=r"rule must be one of \('adaptive', 'cubic'\) .*got 3"):
        igdpa.dpa_scores(model, ids, target, "mask_ig", mask_rule=3)
    with pytest.raises(ValueError, match=r"panels must be increasing edges in u from 0 to 1"):
        igdpa.gate_path_nodes([0.0, 0.7, 0.5, 1.0], 8)
    with pytest.raises(ValueError, match=r"panels must be increasing edges in u from 0 to 1"):
        igdpa.gate_path_nodes([0.1, 1.0], 8)
    with pytest.raises(ValueError, match=r"steps must be an integer >= the 3 panels .*got 2"):
        igdpa.gate_path_nodes([0.0, 0.2, 0.5, 1.0], 2)
    with pytest.raises(ValueError, match=r"points must be an integer in 1\.\.64 .*got 0"):
        igdpa.gate_path_panels(np.sin, 8, 0.0, 1.0, points=0)
    with pytest.raises(ValueError, match=r"floor must be a finite number >= 0, got -1"):
        igdpa.gate_path_panels(np.sin, 8, 0.0, 1.0, floor=-1.0)
    with pytest.raises(ValueError, match=r"f_on must be a finite number, got nan"):
        igdpa.gate_path_panels(np.sin, 8, 0.0, float("nan"))
    with pytest.raises(ValueError, match=r"values must map \(4,\) points t to as many finite numbers, got shape \(2,\)"):
        igdpa.gate_path_panels(lambda t: np.zeros(2), 8, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"steps must be an integer in 1\.\.10000 .*got 0"):
        igdpa.mask_ig(model, ids, target, steps=0)
    with pytest.raises(ValueError, match=r"quantity must be one of \('prob', 'logprob', 'logit'\), got 'logits'"):
        igdpa.mask_ig(model, ids, target, quantity="logits")
    with pytest.raises(ValueError, match=r"context must be None or \(8,\) booleans"):
        igdpa.mask_ig(model, ids, target, context=np.ones(7, bool))
    with pytest.raises(ValueError, match="steps must be a non-empty sequence"):
        igdpa.mask_ig_gaps(model, ids, target, steps=8)
    with pytest.raises(ValueError, match=r"quantity must be one of \('prob', 'logprob'\), got 'logit'"):
        igdpa.dpa_scores(model, ids, target, "mask_ig", quantity="logit")
