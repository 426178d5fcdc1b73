"""The counterfactual graph (iglens_counterfactual): complete at every cut, zero before the swap, parts that
add up by the chain rule, and a one-block model against a hand-written forward and autograd."""
import math

import numpy as np
import pytest
import torch
from torch.func import jvp

import iglens_core as ig
import iglens_counterfactual as igcf
import iglens_facts as igf
from conftest import order_tolerance, sharp_model, tiny_model

ARCHS = ["llama", "qwen2", "gemma3", "gpt2"]


def _pair(model, length=9, at=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    clean = torch.randint(0, vocab, (1, length), generator=gen)
    corrupted = clean.clone()
    corrupted[0, at] = (corrupted[0, at] + 1 + torch.randint(0, vocab - 1, (1,), generator=gen)) % vocab
    return clean, corrupted


def _target(model, clean):
    """A token whose probability the corruption moves: the clean run's arg-max (not a tie: random weights)."""
    with torch.no_grad():
        return int(model(clean).logits[0, -1].argmax())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantity,foil", [("prob", None), ("logprob", 3)])
def test_complete_at_every_cut_float64(arch, quantity, foil):
    """Converged (tolerance 1e-13 of delta): every node's and mid state's row adds up to delta within 1e-10 of it;
    the gaps are the whole incompleteness; before the swap every share is exactly 0."""
    model = sharp_model(arch, seed=ARCHS.index(arch), dtype=torch.float64)
    clean, corrupted = _pair(model, at=3, seed=ARCHS.index(arch))
    target = _target(model, clean)
    foil = None if foil is None or foil != target else foil + 1
    graph = igcf.counterfactual_graph(model, clean, corrupted, target, quantity=quantity, foil=foil, edges=True,
                                      tolerance=1e-13, max_steps=256)
    scale = abs(graph.delta)
    assert scale > 1e-6
    rows = torch.cat([graph.carried, graph.carried_mid]).sum(1)
    assert (rows - graph.delta).abs().max() <= 1e-10 * scale, (rows - graph.delta)
    assert graph.gap == pytest.approx(float(graph.gaps.sum()) + graph.gap_readout, abs=1e-13 * scale)
    # the telescoping: node L's row minus node L-1's is minus that block's two gaps
    for layer in range(graph.n_layers):
        between = graph.carried[layer].sum() - graph.carried[layer + 1].sum()
        assert float(between) == pytest.approx(float(graph.gaps[layer].sum()), abs=1e-13 * scale)
    assert graph.first == 3
    assert (graph.carried[:, :3] == 0).all() and (graph.carried_mid[:, :3] == 0).all()
    assert (graph.heads[..., :3] == 0).all() and (graph.neurons[:, :3] == 0).all()
    assert (graph.edges[:, :, :3] == 0).all()  # queries before the swap read only equal states
    # the readout of the float64 chain is the model's own (a float64 model: eager's float32 softmax aside)
    assert graph.delta == pytest.approx(graph.delta_model, abs=1e-6 * max(1.0, scale))


@pytest.mark.parametrize("arch", ARCHS)
def test_parts_add_up_by_the_chain_rule(arch):
    """Exact at every node, so at any number of steps: edges (value + query + key) sum to the heads; the heads
    to the attention path's share <cot_(L-1) - cot_mid, x - x'>, the neurons to <cot_mid - cot_L, mid - mid'>."""
    model = sharp_model(arch, seed=1, dtype=torch.float64)
    clean, corrupted = _pair(model, at=2, seed=5)
    graph = igcf.counterfactual_graph(model, clean, corrupted, _target(model, clean), quantity="logprob",
                                      edges=True, steps=4, tolerance=1.0)
    assert graph.edges.shape[-1] == len(igcf.PARTS) == 3
    scale = float(graph.carried.abs().max())
    torch.testing.assert_close(graph.edges.sum((-1, -2)), graph.heads, rtol=0, atol=1e-12 * scale)
    d_x = graph.states[0, :-1] - graph.states[1, :-1]  # (n, S, d) block inputs
    d_mid = graph.states_mid[0] - graph.states_mid[1]
    attn = ((graph.cotangents[:-1] - graph.cotangents_mid) * d_x).sum((-1, -2))  # (n,)
    mlp = ((graph.cotangents_mid - graph.cotangents[1:]) * d_mid).sum((-1, -2))
    torch.testing.assert_close(graph.heads.sum((-1, -2)), attn, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(graph.neurons.sum((-1, -2)), mlp, rtol=0, atol=1e-12 * scale)
    # the carried maps are the cotangents against the state differences
    torch.testing.assert_close(graph.carried[:-1], (graph.cotangents[:-1] * d_x).sum(-1), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float32_model_gap_at_default_steps(arch):
    """A float32 model at the default steps: the whole gap within 1e-6 of |delta| (the blocks run as float64
    copies), delta within float32 rounding of the model's own readout."""
    model = sharp_model(arch, seed=2)
    clean, corrupted = _pair(model, at=1, seed=2)
    graph = igcf.counterfactual_graph(model, clean, corrupted, _target(model, clean), parts=False)
    assert abs(graph.gap) <= 1e-6 * abs(graph.delta)
    assert graph.heads is None and graph.neurons is None and graph.edges is None
    eps = torch.finfo(torch.float32).eps
    assert graph.delta == pytest.approx(graph.delta_model, abs=64 * eps)  # two probabilities <= 1, float32
    assert graph.rebuild < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_chain(arch):
    """dtype=torch.float32 (the fast path): every cut adds up to delta within its reported gaps (each refined to
    FLOAT32_TOLERANCE of |delta|) plus the float32 rounding of the row sums; the parts add up by the chain rule
    within float32 rounding; the map is the float64 chain's within float32 rounding carried through the blocks."""
    model = sharp_model(arch, seed=3)
    clean, corrupted = _pair(model, at=2, seed=6)
    target = _target(model, clean)
    ref = igcf.counterfactual_graph(model, clean, corrupted, target, edges=True)
    graph = igcf.counterfactual_graph(model, clean, corrupted, target, edges=True, dtype=torch.float32)
    assert graph.states.dtype == torch.float32 and graph.carried.dtype == torch.float64
    n, S, d = graph.n_layers, clean.shape[1], graph.states.shape[-1]
    # each row sum is S * d float32 products summed in float32 (order_tolerance: eps * length * sum |terms|)
    d_states = graph.states[0] - graph.states[1]
    terms = (graph.cotangents * d_states).abs().sum((-1, -2)).double()  # (n+1,) sum |terms| of each row
    refined = ((graph.gaps.abs() <= igcf.FLOAT32_TOLERANCE * abs(graph.delta)) | (graph.steps == igcf.MAX_STEPS)).all()
    assert refined
    above = torch.cat([graph.gaps.sum(1).flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
    rows = graph.carried.sum(1)
    bound = torch.tensor([order_tolerance(torch.float32, float(t), S * d) for t in terms])
    assert ((rows - graph.delta - above - graph.gap_readout).abs() <= bound).all()
    assert abs(graph.gap) <= (2 * n + 1) * igcf.FLOAT32_TOLERANCE * abs(graph.delta) + float(bound[0])
    heads_scale = float(graph.edges.abs().sum((-1, -2)).max())
    torch.testing.assert_close(graph.edges.sum((-1, -2)), graph.heads, rtol=0,
                               atol=order_tolerance(torch.float32, heads_scale, 3 * S))
    # against float64: float32 rounding (eps * d per product) through every sublayer's Jacobian, 2n of them
    scale = float(ref.carried.abs().max())
    atol = order_tolerance(torch.float32, scale, d) * 2 * n * 4  # 4: the widening of one sublayer's products
    torch.testing.assert_close(graph.carried, ref.carried, rtol=0, atol=atol)
    assert graph.first == ref.first and (graph.carried[:, :graph.first] == 0).all()


def test_bad_dtype_and_readout():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="dtype must be torch.float64 or torch.float32"):
        igcf.counterfactual_graph(model, *_pair(model), 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="readout comes from another model"):
        igcf.counterfactual_graph(model, *_pair(model), 1, readout=ig.Readout(tiny_model("llama", seed=9)))


def _rms(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class _HandBlock:
    """One Llama block written out from its weights (float64): RMSNorm, GQA with rotary, causal softmax, SiLU-gated MLP."""

    def __init__(self, model, S):
        layer, self.model = model.model.layers[0], model
        attn, mlp = layer.self_attn, layer.mlp
        self.eps = model.config.rms_norm_eps
        self.H, self.Hkv = model.config.num_attention_heads, model.config.num_key_value_heads
        self.hd = model.config.hidden_size // self.H
        self.w1, self.w2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.Wq, self.Wk, self.Wv, self.Wo = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
        self.Wg, self.Wu, self.Wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        positions = torch.arange(S)[None]
        inv = model.model.rotary_emb.inv_freq.double()  # (hd / 2,) the model's rotary frequencies
        freqs = positions[..., None].double() * inv
        emb = torch.cat([freqs, freqs], -1)  # (1, S, hd)
        self.cos, self.sin = emb.cos()[:, None], emb.sin()[:, None]  # (1, 1, S, hd)
        self.mask = torch.full((S, S), -math.inf).triu(1).double()

    def qkv(self, x):
        n1 = _rms(x, self.w1, self.eps)
        B, S, _ = x.shape
        q = (n1 @ self.Wq.T).view(B, S, self.H, self.hd).transpose(1, 2)
        k = (n1 @ self.Wk.T).view(B, S, self.Hkv, self.hd).transpose(1, 2)
        v = (n1 @ self.Wv.T).view(B, S, self.Hkv, self.hd).transpose(1, 2)
        return _rotate(q, self.cos, self.sin), _rotate(k, self.cos, self.sin), v

    def attend(self, q, k, v):
        """-> raw scores (B, H, S, S), pattern, head outputs z (B, H, S, hd)."""
        g = self.H // self.Hkv
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        raw = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        pattern = torch.softmax(raw + self.mask, -1)
        return raw, pattern, pattern @ v

    def project(self, z):
        B, _, S, _ = z.shape
        return z.transpose(1, 2).reshape(B, S, -1) @ self.Wo.T

    def attn(self, x):
        return self.project(self.attend(*self.qkv(x))[2])

    def neurons(self, mid):
        n2 = _rms(mid, self.w2, self.eps)
        return torch.nn.functional.silu(n2 @ self.Wg.T) * (n2 @ self.Wu.T)

    def mlp(self, mid):
        return self.neurons(mid) @ self.Wd.T

    def f(self, h, target):
        logits = _rms(h, self.model.model.norm.weight, self.eps) @ self.model.lm_head.weight.T
        return torch.softmax(logits, -1)[..., target]


@torch.enable_grad()  # other tests (the command line) turn autograd off for the process
def test_one_block_against_a_hand_derivation():
    """A one-block Llama (GQA, random norm weights), float64: the carried maps, heads, neurons and edge parts
    against the same integrals taken from a hand-written forward with autograd (full Jacobians) and forward-mode
    jvp at 48 Gauss-Legendre nodes."""
    model = igf.tiny_model("llama", seed=3, n_layers=1, init_scale=0.3).double()
    S, target = 7, 5
    clean = torch.randint(0, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    corrupted[0, [2, S - 1]] = (clean[0, [2, S - 1]] + 7) % model.config.vocab_size  # queries move too
    graph = igcf.counterfactual_graph(model, clean, corrupted, target, edges=True, steps=48, tolerance=1.0)
    hand = _HandBlock(model, S)
    with torch.no_grad():
        x, x_bad = (model.model.embed_tokens(ids)[0].double() for ids in (clean, corrupted))
        mid, mid_bad = x + hand.attn(x[None])[0], x_bad + hand.attn(x_bad[None])[0]
        out, out_bad = mid + hand.mlp(mid[None])[0], mid_bad + hand.mlp(mid_bad[None])[0]
    torch.testing.assert_close(graph.states[0, 1], out, rtol=0, atol=1e-12)
    assert graph.f_clean == pytest.approx(float(hand.f(out[-1], target).detach()), abs=1e-14)
    nodes, weights = ig.quadrature("gauss_legendre", 48)

    def mean_gradient(fn, start, end):
        return sum(w * torch.autograd.functional.jacobian(fn, start + a * (end - start)) for a, w in zip(nodes, weights))

    cot_top = torch.zeros(S, x.shape[1], dtype=torch.float64)
    cot_top[-1] = mean_gradient(lambda h: hand.f(h, target), out_bad[-1], out[-1])
    J_mlp = mean_gradient(lambda m: hand.mlp(m[None])[0], mid_bad, mid)  # (S, d, S, d)
    cot_mid = cot_top + torch.einsum("sd,sdte->te", cot_top, J_mlp)
    J_attn = mean_gradient(lambda h: hand.attn(h[None])[0], x_bad, x)
    cot_in = cot_mid + torch.einsum("sd,sdte->te", cot_mid, J_attn)
    want = torch.stack([(cot_in * (x - x_bad)).sum(-1), (cot_top * (out - out_bad)).sum(-1)])
    torch.testing.assert_close(graph.carried, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(graph.carried_mid[0], (cot_mid * (mid - mid_bad)).sum(-1), rtol=0, atol=1e-12)

    # heads, neurons and edge parts: gradient (reverse) times tangent (forward) at each node, integrated
    heads = torch.zeros(hand.H, S, dtype=torch.float64)
    parts = torch.zeros(hand.H, S, S, 3, dtype=torch.float64)
    neurons = torch.zeros(S, hand.Wd.shape[1], dtype=torch.float64)
    through = torch.zeros(3, dtype=torch.float64)  # the values', queries' and keys' whole credit
    for a, w in zip(nodes, weights):
        point, dx = x_bad + a * (x - x_bad), x - x_bad
        (q, k, v), (dq, dk, dv) = jvp(lambda h: hand.qkv(h[None]), (point,), (dx,))
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        raw, pattern, z = hand.attend(q, k, v)
        g_raw, g_z, g_q, g_k, g_v = torch.autograd.grad((hand.project(z)[0] * cot_mid).sum(), [raw, z, q, k, v])
        through += w * torch.stack([(g_v * dv).sum(), (g_q * dq).sum(), (g_k * dk).sum()])
        _, dz = jvp(lambda h: hand.attend(*hand.qkv(h[None]))[2], (point,), (dx,))
        heads += w * (g_z * dz)[0].sum(-1)
        g = hand.H // hand.Hkv
        k_h, dk_h, dv_h = (t.repeat_interleave(g, 1)[0] for t in (k.detach(), dk, dv))
        parts[..., 0] += w * pattern[0].detach() * (g_z[0] @ dv_h.transpose(-1, -2))
        parts[..., 1] += w * g_raw[0] * (dq[0] @ k_h.transpose(-1, -2)) / math.sqrt(hand.hd)
        parts[..., 2] += w * g_raw[0] * (q[0].detach() @ dk_h.transpose(-1, -2)) / math.sqrt(hand.hd)
        m_point, dm = mid_bad + a * (mid - mid_bad), mid - mid_bad
        u, du = jvp(lambda m: hand.neurons(m[None])[0], (m_point,), (dm,))
        u = u.detach().requires_grad_(True)
        (g_u,) = torch.autograd.grad(((u @ hand.Wd.T) * cot_top).sum(), u)
        neurons += w * g_u * du
    torch.testing.assert_close(graph.heads[0], heads, rtol=0, atol=1e-12)
    torch.testing.assert_close(graph.edges[0], parts, rtol=0, atol=1e-12)
    torch.testing.assert_close(graph.neurons[0], neurons, rtol=0, atol=1e-12)
    # each part over every edge is the whole credit of the values, the queries, the keys (autograd through each alone)
    torch.testing.assert_close(graph.edges[0].sum((0, 1, 2)), through.detach(), rtol=0, atol=1e-12)
    assert (through.abs() > 1e-6).all()


def test_restoration_layout_and_refinement():
    model = sharp_model("llama", seed=4)
    clean, corrupted = _pair(model, at=0, seed=4)
    graph = igcf.counterfactual_graph(model, clean, corrupted, _target(model, clean), parts=False, steps=2,
                                      tolerance=1e-9, max_steps=64)
    assert graph.restoration().shape == (clean.shape[1], graph.n_layers + 1)
    torch.testing.assert_close(graph.restoration()[-1, -1], torch.tensor(1.0 + graph.gap_readout / graph.delta,
                                                                          dtype=torch.float64))
    assert (graph.steps > 2).any()  # two nodes are too few somewhere: refined
    assert ((graph.gaps.abs() <= 1e-9 * abs(graph.delta)) | (graph.steps == 64)).all()


@pytest.mark.parametrize("change,match", [
    (lambda c, b: (c, b[:, :-1]), "same length"),
    (lambda c, b: (c, c.clone()), "identical"),
])
def test_bad_pairs(change, match):
    model = tiny_model("llama")
    clean, corrupted = change(*_pair(model))
    with pytest.raises(ValueError, match=match):
        igcf.counterfactual_graph(model, clean, corrupted, 1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(steps=0), "steps must be an integer in 1..256"), (dict(max_steps=0), "max_steps"),
    (dict(tolerance=-1.0), "tolerance"), (dict(tolerance=float("nan")), "tolerance"),
    (dict(quantity="logit"), "quantity"), (dict(foil=1), "foil equals the target"),
    (dict(edges=1), "edges must be True or False"), (dict(min_delta=2.0), "min_delta=2.0"),
])
def test_bad_arguments(kwargs, match):
    model = tiny_model("llama")
    clean, corrupted = _pair(model)
    with pytest.raises(ValueError, match=match):
        igcf.counterfactual_graph(model, clean, corrupted, 1, **kwargs)


def test_training_mode_and_parallel_blocks_refused():
    model = tiny_model("llama").train()
    with pytest.raises(ValueError, match="training mode"):
        igcf.counterfactual_graph(model, *_pair(model), 1)
    model = tiny_model("neox")
    with pytest.raises(ValueError, match="parallel attention"):
        igcf.counterfactual_graph(model, *_pair(model), 1)


def test_non_finite_weights_named():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf.*layers\.1\.mlp\.down_proj\.weight"):
        igcf.counterfactual_graph(model, *_pair(model), 1)


def test_cli_corrupted(tmp_path, monkeypatch, capsys):
    """``iglens graph PROMPT --corrupted TEXT --json``: the file holds the counterfactual graph of the first answer
    token, equal to counterfactual_graph's; a corrupted prompt of another length is one line of error; ``--html``
    writes its page, the carried map and the heads' shares embedded as they are."""
    import json
    import iglens_cli as igcli
    model = tiny_model("llama", seed=5)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=gen)
    bad = ids.clone()
    bad[0, 1] = (ids[0, 1] + 3) % model.config.vocab_size
    short = ids[:, 1:]
    monkeypatch.setattr(igcli, "encode", lambda tokenizer, prompt, answer=None, **kw: {
        "a prompt": (ids, 4), "other": (bad, 4), "short": (short, 3)}[prompt])

    class Decode:
        def decode(self, ids):
            return str(list(ids))
    monkeypatch.setattr(igcli, "load_model", lambda name: (model, Decode()))
    out = tmp_path / "cf.json"
    assert igcli.main(["graph", "a prompt", "--corrupted", "other", "--json", str(out), "--quantity", "logprob"]) == 0
    data = json.loads(out.read_text())
    want = igcf.counterfactual_graph(model, ids[:, :4], bad[:, :4], int(ids[0, 4]), quantity="logprob")
    torch.testing.assert_close(torch.tensor(data["carried"], dtype=torch.float64), want.carried, rtol=0, atol=1e-12)
    assert data["delta"] == pytest.approx(want.delta, abs=1e-12) and "adds up to it" in capsys.readouterr().out
    assert igcli.main(["graph", "a prompt", "--corrupted", "short", "--json", str(out)]) == 2
    assert "--corrupted must tokenize to the prompt's length" in capsys.readouterr().err
    page = tmp_path / "cf.html"  # the page: the carried map and the heads, their numbers embedded
    assert igcli.main(["graph", "a prompt", "--corrupted", "other", "--html", str(page), "--quantity", "logprob"]) == 0
    text = page.read_text()
    embedded = json.loads(text.split('<script type="application/json" id="iglens-contrast-data">')[1].split("</script>")[0])
    torch.testing.assert_close(torch.tensor(embedded["carried"], dtype=torch.float64), want.carried, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.tensor(embedded["heads"], dtype=torch.float64), want.heads.sum(-1), rtol=0, atol=1e-12)
    assert embedded["corrupted_tokens"][1] == str([int(bad[0, 1])]) != embedded["tokens"][1]
    assert "Plotly.newPlot" in text and f"delta {want.delta:+.4g}" in text and str(page) in capsys.readouterr().out
