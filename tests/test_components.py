"""Every head and every MLP neuron in probability space (issue 15): completeness, the split of the
increment, and each share against an independent computation (hooks, weight slices, autograd)."""
import copy

import numpy as np
import pytest
import torch

import iglens_baselines as igb
import iglens_causal as igc
import iglens_core as ig
from conftest import blocks, sharp_model

# per architecture: (attention output projection, MLP down projection) inside a block, found here
# by name, independently of the core's lookup
PROJECTIONS = {"llama": ("self_attn.o_proj", "mlp.down_proj"), "gemma3": ("self_attn.o_proj", "mlp.down_proj"),
               "gpt2": ("attn.c_proj", "mlp.c_proj"), "neox": ("attention.dense", "mlp.dense_4h_to_h")}
ARCHS = list(PROJECTIONS)


def trace_of(model, seed=0, length=12, prompt_len=5):
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    return ig.collect_components(model, ids, prompt_len)


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    torch.set_grad_enabled(False)
    model = sharp_model(request.param, seed=ARCHS.index(request.param))
    return request.param, model, trace_of(model)


def reference_parts(arch, model, trace):
    """Per block: the head parts (T, H, d) and neuron parts (T, d_ff, d), biases (d,), built from
    hooks on the projections' inputs and the projections' weight slices; Gemma's post-norms
    applied by their own formula ``(1 + w) * u / sqrt(mean(u^2) + eps)`` at the whole output u."""
    attn_name, mlp_name = PROJECTIONS[arch]
    inputs = {}
    hooks = []
    for layer, block in enumerate(blocks(model)):
        for kind, name in (("attn", attn_name), ("mlp", mlp_name)):
            module = block.get_submodule(name)
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args, key=(layer, kind): inputs.__setitem__(key, args[0][0].detach().double())))
    try:
        model(trace.input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    heads = model.config.num_attention_heads
    out = []
    for layer, block in enumerate(blocks(model)):
        entry = {}
        for kind, name in (("attn", attn_name), ("mlp", mlp_name)):
            module = block.get_submodule(name)
            weight = module.weight.detach().double()
            weight = weight if isinstance(module, torch.nn.Linear) else weight.T  # Conv1D: (in, out)
            bias = module.bias.detach().double() if module.bias is not None else torch.zeros(weight.shape[0],
                                                                                             dtype=torch.float64)
            x = inputs[(layer, kind)][trace.positions]  # (T, P)
            groups = heads if kind == "attn" else x.shape[-1]
            width = x.shape[-1] // groups
            parts = torch.stack([x[:, g * width:(g + 1) * width] @ weight[:, g * width:(g + 1) * width].T
                                 for g in range(groups)], 1)  # (T, G, d)
            bias = bias.expand(len(x), -1)
            if arch == "gemma3":
                post = block.post_attention_layernorm if kind == "attn" else block.post_feedforward_layernorm
                total = parts.sum(1) + bias
                factor = (1 + post.weight.detach().double()) / torch.sqrt(total.pow(2).mean(-1, keepdim=True)
                                                                           + post.eps)
                parts, bias = parts * factor[:, None], bias * factor
            entry[kind] = (parts, bias)
        out.append(entry)
    return out


def autograd_shares(readout, trace, parts, bias, start, end, m):
    """sum_s w_s <delta_k, grad f(start + alpha_s (end - start))>, grad by torch.autograd of the
    head-once readout (float64); (T, G+1)."""
    nodes, weights = np.polynomial.legendre.leggauss(m)
    alphas, weights = (nodes + 1) / 2, weights / 2
    start, end = start.double(), end.double()
    shares = torch.zeros(parts.shape[0], parts.shape[1] + 1, dtype=torch.float64)
    with torch.enable_grad():
        for alpha, weight in zip(alphas, weights):
            point = (start + alpha * (end - start)).requires_grad_(True)
            f = torch.softmax(readout.logits(point), -1).gather(-1, trace.targets[:, None]).sum()
            (grad,) = torch.autograd.grad(f, point)
            shares[:, :-1] += weight * (parts * grad[:, None]).sum(-1)
            shares[:, -1] += weight * (bias * grad).sum(-1)
    return shares


def test_parts_sum_to_sublayer_terms(case):
    arch, model, trace = case
    result = ig.components(model, trace, steps=64)
    T, n = len(trace.targets), trace.n_layers
    assert result.heads.shape == (T, n, model.config.num_attention_heads + 1)
    assert result.neurons.shape[:2] == (T, n) and result.neurons.shape[2] == trace.neurons.shape[-1] + 1
    lens = ig.Readout(model)(torch.cat([trace.hidden[:1], ig.path_nodes(trace, range(1, n + 1), "sublayer")[0]]),
                             trace.targets[None]).T.double()  # (T, 2n+1)
    attn, mlp = (lens[:, 1::2] - lens[:, 0:-1:2]), (lens[:, 2::2] - lens[:, 1::2])
    assert float(attn.abs().max()) > 1e-2 or float(mlp.abs().max()) > 1e-2  # the terms are not tiny
    torch.testing.assert_close(result.heads.double().sum(-1), attn, atol=1e-6, rtol=0)
    torch.testing.assert_close(result.neurons.double().sum(-1), mlp, atol=1e-6, rtol=0)
    assert result.residual_heads < 1e-6 and result.residual_neurons < 1e-6
    torch.testing.assert_close(result.delta_p.double(), lens[:, -1] - lens[:, 0], atol=1e-6, rtol=0)


def test_error_falls_with_steps(case):
    arch, model, trace = case
    errors = [max(ig.components(model, trace, steps=m).residual_heads,
                  ig.components(model, trace, steps=m).residual_neurons) for m in (1, 4, 64)]
    assert errors[0] > 1e-5, errors  # the coarse rule is visibly wrong: the test can fail
    assert errors[0] > errors[1] > errors[2] or errors[2] < 1e-7, errors
    assert errors[2] < 1e-6, errors


def test_parts_rebuild_the_increment(case):
    arch, model, trace = case
    reference = reference_parts(arch, model, trace)
    for layer, entry in enumerate(reference):
        for kind, start, end in (("attn", trace.hidden[layer], trace.mid[layer]),
                                 ("mlp", trace.mid[layer], trace.hidden[layer + 1])):
            parts, bias = entry[kind]
            rebuilt = parts.sum(1) + bias
            increment = (end - start).double()
            assert float((rebuilt - increment).norm() / increment.norm()) < 1e-5, (arch, layer, kind)
    assert ig.components(model, trace, steps=2).rebuild < 1e-5


def test_each_share_matches_autograd(case):
    arch, model, trace = case
    m = 12
    result = ig.components(model, trace, steps=m)
    reference = reference_parts(arch, model, trace)
    readout = ig.Readout(copy.deepcopy(model).double())
    for layer, entry in enumerate(reference):
        for kind, start, end, ours in (("attn", trace.hidden[layer], trace.mid[layer], result.heads),
                                       ("mlp", trace.mid[layer], trace.hidden[layer + 1], result.neurons)):
            parts, bias = entry[kind]
            expected = autograd_shares(readout, trace, parts, bias, start, end, m)
            torch.testing.assert_close(ours[:, layer].double(), expected, atol=1e-5, rtol=0,
                                       msg=lambda text: f"{arch} block {layer + 1} {kind}: {text}")


@pytest.mark.parametrize("arch", ["gpt2", "neox"])
def test_float64_reaches_the_float_floor(arch):
    # LayerNorm models: transformers' RMSNorms compute in float32 even in a float64 model, which
    # leaves a floor near 1e-9 there
    model = sharp_model(arch, dtype=torch.float64)
    trace = trace_of(model, seed=3)
    coarse, fine = (ig.components(model, trace, steps=m) for m in (2, 64))
    assert max(coarse.residual_heads, coarse.residual_neurons) > 1e-8
    assert fine.residual_heads < 1e-12 and fine.residual_neurons < 1e-12 and fine.rebuild < 1e-12
    assert fine.heads.dtype == torch.float64


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
def test_prediction_aware_split_is_complete_at_every_m(arch):
    dtype = torch.float64 if arch == "gpt2" else torch.float32  # RMSNorms compute in float32 anyway
    model = sharp_model(arch, dtype=dtype)
    trace = trace_of(model, seed=5)
    reference = ig.components(model, trace, steps=64)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    gaps = []
    for m in (1, 3, 24):
        split = ig.components(model, trace, steps=m, estimator="prediction_aware")
        assert split.residual_heads < tol and split.residual_neurons < tol, (m, split.residual_heads)
        gaps.append(float((split.neurons - reference.neurons).abs().max()))
    coarse = ig.components(model, trace, steps=1)
    assert max(coarse.residual_heads, coarse.residual_neurons) > 100 * tol  # Gauss-Legendre at m=1 is not
    assert gaps[0] > gaps[2] and gaps[2] < 1e-4, gaps  # the shares converge to the integral


def test_resolution_picks_the_split(case):
    arch, model, trace = case
    both = ig.components(model, trace, steps=8)
    heads = ig.components(model, trace, steps=8, resolution="head")
    neurons = ig.components(model, trace, steps=8, resolution="neuron")
    assert heads.neurons is None and neurons.heads is None and np.isnan(heads.residual_neurons)
    torch.testing.assert_close(heads.heads, both.heads)
    torch.testing.assert_close(neurons.neurons, both.neurons)


def test_memory_budget_chunks_give_the_same_shares(case):
    arch, model, trace = case
    small = ig.Readout(model, memory_budget=97 * 16 * 5)  # one token's grid of 5 points per chunk (check_steps' least)
    torch.testing.assert_close(ig.components(model, trace, steps=5, readout=small).neurons,
                               ig.components(model, trace, steps=5).neurons, atol=1e-7, rtol=0)


def test_collect_components_is_collect_plus_records(case):
    arch, model, trace = case
    plain = ig.collect(model, trace.input_ids, trace.prompt_len, sublayer=True)
    torch.testing.assert_close(trace.hidden, plain.hidden, atol=0, rtol=0)
    torch.testing.assert_close(trace.mid, plain.mid, atol=0, rtol=0)
    assert trace.heads.shape[:2] == trace.neurons.shape[:2] == (trace.n_layers, len(trace.targets))


def test_bad_input():
    model = sharp_model("llama")
    trace = trace_of(model)
    with pytest.raises(ValueError, match="resolution must be one of"):
        ig.components(model, trace, resolution="layer")
    for steps in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="steps must be an integer >= 1"):
            ig.components(model, trace, steps=steps)
    with pytest.raises(ValueError, match="estimator must be one of"):
        ig.components(model, trace, estimator="simpson")
    plain = ig.collect(model, trace.input_ids, trace.prompt_len, sublayer=True)
    with pytest.raises(ValueError, match="collect_components"):
        ig.components(model, plain)
    with pytest.raises(ValueError, match="collect_components"):
        igb.component_dla(model, plain)
    with pytest.raises(ValueError, match="resolution must be 'head', 'neuron' or 'source', got 'both'"):
        igb.component_dla(model, trace, resolution="both")
    with pytest.raises(ValueError, match=r"block in 1..3 and index in 0..3"):
        igc.component_ablation(model, trace, [[(1, 4)]])
    with pytest.raises(ValueError, match="mode must be one of"):
        igc.component_ablation(model, trace, [[(1, 0)]], mode="resample")


# -- iglens_compare: head DLA and component ablation -------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_component_dla_adds_up_to_block_dla(arch):
    model = sharp_model(arch, seed=1)
    trace = trace_of(model, seed=1)
    heads = igb.component_dla(model, trace, resolution="head")
    neurons = igb.component_dla(model, trace, resolution="neuron")
    assert heads.shape[-1] == model.config.num_attention_heads + 1
    block = igb.direct_logit_attribution(model, trace)  # (T, n) from the residual stream alone
    torch.testing.assert_close(heads.sum(-1) + neurons.sum(-1), block, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "neox"])
def test_component_ablation_equals_zeroed_weights(arch):
    model = sharp_model(arch, seed=2)
    trace = trace_of(model, seed=2)
    sets = [[(2, 1)], [(1, 0), (3, 3)], []]
    for resolution, (name, width) in (("head", (PROJECTIONS[arch][0], 32 // 4)), ("neuron", (PROJECTIONS[arch][1], 1))):
        drops = igc.component_ablation(model, trace, sets, resolution=resolution, batch_size=2)
        for column, chosen in enumerate(sets):
            edited = copy.deepcopy(model)
            with torch.no_grad():
                for layer, index in chosen:
                    module = blocks(edited)[layer - 1].get_submodule(name)
                    columns = slice(index * width, (index + 1) * width)
                    if isinstance(module, torch.nn.Linear):
                        module.weight[:, columns] = 0
                    else:  # Conv1D: (in, out)
                        module.weight[columns] = 0
                logits = edited(trace.input_ids, use_cache=False).logits[0, trace.positions]
            p = torch.softmax(logits, -1).gather(-1, trace.targets[:, None])[:, 0]
            torch.testing.assert_close(drops[:, column], trace.model_probs - p, atol=1e-5, rtol=0)
    assert float(drops[:, 0].abs().max()) > 1e-4  # ablating something changes something


def test_component_ablation_mean_mode():
    model = sharp_model("llama", seed=4)
    trace = trace_of(model, seed=4)
    drops = igc.component_ablation(model, trace, [[(2, 3)]], mode="mean")[:, 0]
    inputs = {}
    module = blocks(model)[1].self_attn.o_proj
    hook = module.register_forward_pre_hook(lambda mod, args: inputs.__setitem__("z", args[0][0]))
    model(trace.input_ids, use_cache=False)
    hook.remove()
    columns = slice(24, 32)
    edited = copy.deepcopy(model)
    target = blocks(edited)[1].self_attn.o_proj
    with torch.no_grad():  # mean ablation = zeroed columns plus their mean output as a bias
        target.bias = torch.nn.Parameter(module.weight[:, columns] @ inputs["z"][:, columns].mean(0))
        target.weight[:, columns] = 0
        logits = edited(trace.input_ids, use_cache=False).logits[0, trace.positions]
    p = torch.softmax(logits, -1).gather(-1, trace.targets[:, None])[:, 0]
    torch.testing.assert_close(drops, trace.model_probs - p, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("gemma3", torch.bfloat16), ("gpt2", torch.bfloat16),
                                        ("gpt2", torch.float16)])
def test_components_in_bfloat16_and_float16(arch, dtype):
    """Issue 30: bfloat16 (about 3 significant digits) runs. The parts are computed in float32 or
    better from the model's own bf16 activations; the rebuild check allows the stream's bf16
    rounding. Held to: the parts add up to the attention and MLP terms within eps_bf16 * max |f|
    (2^-7 of the largest f on the path: f itself is read out in bf16), and every share, term and
    node of the lens agrees with the float32 model's within 5% of the float32 values' largest plus
    that same eps_bf16 * max |f| (a term is a difference of two f read in bf16). float16 (GPT-2:
    its LayerNorm's tangent overflowed under torch.func) is held to its own eps."""
    from conftest import order_tolerance, tiny_model
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    found = {}
    for kind in (torch.float32, dtype):
        model = tiny_model(arch, seed=1, dtype=kind)
        found[kind] = ig.components(model, ig.collect_components(model, ids, 5), resolution="both")
    low, ref = found[dtype], found[torch.float32]
    assert low.heads.dtype == torch.float32 and low.rebuild < 1e-2
    tol = order_tolerance(dtype, float(low.lens.abs().max()), 1)  # one rounding of f read in low precision
    assert float((low.heads.sum(-1) - low.attn).abs().max()) <= tol
    assert float((low.neurons.sum(-1) - low.mlp).abs().max()) <= tol
    for name in ("heads", "neurons", "attn", "mlp", "lens"):
        expected = getattr(ref, name)
        torch.testing.assert_close(getattr(low, name), expected, atol=0.05 * float(expected.abs().max()) + tol, rtol=0)
    import iglens_dpa as igdpa  # dpa_scores(..., "ig_lens") goes through components with sources
    scores = igdpa.dpa_scores(model, ids[:, :9], 5, "ig_lens")  # the bfloat16 model
    assert torch.isfinite(scores["edges"]).all() and scores["edges"].abs().max() > 0
