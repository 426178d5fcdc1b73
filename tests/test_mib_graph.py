"""The counterfactual graph on MIB's edges (iglens_mib_graph): complete at every node (the edges into the
logits add up to the model's own change in the logit difference, every node's inflow equals its outflow, the
edges out of the input add up to the change), and each head's inflow equal to the residual-level counterfactual
graph's head share (iglens_counterfactual, an independent construction: float64 block copies, its own attention)."""
import pytest
import torch
import transformers

import iglens_core as ig
import iglens_counterfactual as igcf
import iglens_mib as mib
import iglens_mib_graph as igmg
from conftest import tiny_model
from test_mib import pair

ARCHS = ["llama", "gpt2", "gemma3"]  # GQA and rotary; fused c_attn with biases; q/k norms, post-norms, soft-cap
LABELS = torch.tensor([[5, 9], [3, 7]])


@pytest.fixture(autouse=True)
def float64_softmax(monkeypatch):
    """Hugging Face's eager attention takes its softmax in float32 whatever the dtype (Llama, Qwen): kept in
    float64 here, so that a float64 model's identities hold to float64 rounding."""
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        return original(input, dim=dim, dtype=None if input.dtype == torch.float64 else dtype)
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    # Gemma 3's RMSNorm casts to float32 and back: kept in the input's dtype for a float64 model
    norm = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm
    monkeypatch.setattr(norm, "forward", lambda self, x: self._norm(x) * (1.0 + self.weight.to(x)))


def _items(model, clean, corrupted):
    """IOI-shaped items over random ids (the method reads only ids and the two label tokens)."""
    return [mib.IOIItem("", "", "", "", "ABBA", 0, clean[b], corrupted[b], int(LABELS[b, 0]), int(LABELS[b, 1]))
            for b in range(len(clean))]


@pytest.mark.parametrize("arch", ARCHS)
def test_complete_at_every_node(arch):
    model = tiny_model(arch, seed=ARCHS.index(arch), dtype=torch.float64)
    graph = mib.MIBGraph.from_model(model)
    clean, corrupted = pair(seed=1, batch=2, length=8)
    result = igmg.counterfactual_edges(model, _items(model, clean, corrupted), steps=64)
    with torch.no_grad():  # the model's own change in the logit difference, per item
        own = (mib.logit_diff(model(clean).logits[:, -1], LABELS) - mib.logit_diff(model(corrupted).logits[:, -1], LABELS))
    torch.testing.assert_close(result.delta, own.double(), rtol=0, atol=1e-12)
    delta, scale = float(own.sum()), float(own.abs().sum())
    scores = result.scores
    assert float(scores[:, -1].sum()) == pytest.approx(delta, abs=1e-12 * scale)       # into the logits
    assert float(scores[0].sum()) == pytest.approx(delta, abs=1e-10 * scale)           # out of the input
    assert abs(result.gaps["input"]) <= 1e-10 * scale and result.gaps["nodes"] <= 1e-10 * scale
    # every node: the edges into its receivers add up to the edges out of it
    for f in range(1, graph.n_forward):
        inflow = scores[:, graph.forward_to_backward[f]].sum()
        assert float(inflow) == pytest.approx(float(scores[f].sum()), abs=1e-10 * scale), graph.nodes[f]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_heads_match_the_residual_counterfactual_graph(arch):
    """One item: each head's inflow (its q, k and v edges) equals iglens_counterfactual's head share for the
    logit difference (log p(y) - log p(foil)), and each MLP's its neurons' share. Not Gemma: there the
    post-attention norm is linearised on its own path here (MIB's harness blends the heads before it), inside
    the block's path there, two complete splits that differ."""
    model = tiny_model(arch, seed=2, dtype=torch.float64)
    graph = mib.MIBGraph.from_model(model)
    clean, corrupted = pair(seed=3, batch=1, length=7)
    result = igmg.counterfactual_edges(model, _items(model, clean, corrupted), steps=64)
    reference = igcf.counterfactual_graph(model, clean, corrupted, int(LABELS[0, 0]), foil=int(LABELS[0, 1]),
                                          quantity="logprob", tolerance=1e-13)
    scale = abs(reference.delta)
    assert float(result.delta[0]) == pytest.approx(reference.delta, abs=1e-12 * max(scale, 1.0))
    for L in range(graph.n_layers):
        for h in range(graph.n_heads):
            inflow = sum(result.scores[:, graph.backward_index(f"a{L}.h{h}", x)].sum() for x in "qkv")
            assert float(inflow) == pytest.approx(float(reference.heads[L, h].sum()), abs=1e-9 * scale), (L, h)
        mlp = result.scores[:, graph.backward_index(f"m{L}")].sum()
        assert float(mlp) == pytest.approx(float(reference.neurons[L].sum()), abs=1e-9 * scale), L


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="steps must be an integer in 1..256"):
        igmg.counterfactual_edges(model, _items(model, *pair(batch=1)), steps=0)
    with pytest.raises(ValueError, match="at least one"):
        igmg.counterfactual_edges(model, [])


@pytest.mark.parametrize("arch", ARCHS)
def test_mask_ig_complete_and_equal_to_finite_differences(arch):
    """Mask IG over MIB's edge gates: the scores add up to the model's own change in the logit difference
    (converged steps), only edges of MIB's graph score, and one edge's score equals the same quadrature of
    central finite differences of the patched forward (no autograd)."""
    model = tiny_model(arch, seed=5 + ARCHS.index(arch), dtype=torch.float64)
    graph, layers = mib.MIBGraph.from_model(model), mib.model_layers(model)
    clean, corrupted = pair(seed=4, batch=1, length=6)
    result = igmg.mask_ig_edges(model, _items(model, clean, corrupted), steps=48)
    with torch.no_grad():
        own = (mib.logit_diff(model(clean).logits[:, -1], LABELS[:1]) -
               mib.logit_diff(model(corrupted).logits[:, -1], LABELS[:1]))
    scale = float(own.abs().sum())
    torch.testing.assert_close(result.delta, own.double(), rtol=0, atol=1e-12 * scale)
    assert float(result.scores.sum()) == pytest.approx(float(own.sum()), abs=1e-10 * scale)
    assert abs(result.gaps["total"]) <= 1e-10 * scale
    on_graph = torch.zeros_like(result.scores, dtype=torch.bool)
    on_graph[graph.edge_src, graph.edge_dst] = True
    assert float(result.scores[~on_graph].abs().max()) == 0.0
    # the largest edge by finite differences at the same nodes (8 of them)
    result = igmg.mask_ig_edges(model, _items(model, clean, corrupted), steps=8)
    f, b = divmod(int(result.scores.abs().argmax()), graph.n_backward)
    acts = mib.record_acts(model, graph, layers, corrupted)[0]
    alphas, weights = ig.quadrature("gauss_legendre", 8)
    h, fd = 1e-5, 0.0
    for alpha, weight in zip(alphas.tolist(), weights.tolist()):
        values = []
        for step in (h, -h):
            gates = torch.full((graph.n_forward, graph.n_backward), alpha, dtype=torch.float64)
            gates[f, b] += step
            values.append(mib.logit_diff(mib.patched_logits(model, graph, layers, clean, gates, acts), LABELS[:1]).sum())
        fd += weight * float(values[0] - values[1]) / (2 * h)
    assert fd == pytest.approx(float(result.scores[f, b]), rel=1e-6)
