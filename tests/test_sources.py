"""Every (block, head, source position) share (issue 21): the sources add up to the head shares,
and each one equals an independent computation (eager attention's own patterns, values from a hook
on the value projection, the head's slice of the output projection, the readout's integrated
gradient by autograd)."""
import copy

import numpy as np
import pytest
import torch

import iglens_core as ig
from conftest import blocks, sharp_model

# per architecture, found here by name, independently of the core's lookup: the attention module
# inside a block, the module whose output holds the values, how to cut them out ((L, width) ->
# (L, H_kv, hd)), and the output projection
HEADS, KV_HEADS = 4, {"llama": 2, "gemma3": 2, "qwen2": 2, "gpt2": 4}
LAYOUT = {
    "llama": ("self_attn", "self_attn.v_proj", lambda out: out.view(len(out), 2, -1), "self_attn.o_proj"),
    "gemma3": ("self_attn", "self_attn.v_proj", lambda out: out.view(len(out), 2, -1), "self_attn.o_proj"),
    "qwen2": ("self_attn", "self_attn.v_proj", lambda out: out.view(len(out), 2, -1), "self_attn.o_proj"),
    "gpt2": ("attn", "attn.c_attn", lambda out: out[:, 64:].view(len(out), 4, -1), "attn.c_proj"),
}
ARCHS = list(LAYOUT)


def trace_of(model, seed=0, length=12, prompt_len=5):
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    return ig.collect_components(model, ids, prompt_len, sources=True)


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    torch.set_grad_enabled(False)
    model = sharp_model(request.param, seed=ARCHS.index(request.param), dtype=torch.float64, scale=4.0)
    return request.param, model, trace_of(model, seed=ARCHS.index(request.param))


def test_sources_add_up_to_head_shares(case):
    arch, model, trace = case
    result = ig.components(model, trace, resolution="all", steps=16)
    T, n, S = len(trace.targets), trace.n_layers, trace.input_ids.shape[1]
    assert result.sources.shape == (T, n, HEADS, S) and result.sources.dtype == torch.float64
    assert float(result.heads[..., :-1].abs().max()) > 1e-3  # the shares are not tiny
    torch.testing.assert_close(result.sources.sum(-1), result.heads[..., :-1], atol=1e-9, rtol=0)
    assert result.residual_sources < 1e-9
    # nothing comes from a position after the predicting one (causal attention)
    after = torch.arange(S)[None, :] > trace.positions[:, None]  # (T, S)
    assert float(result.sources.abs().amax((1, 2))[after].max()) == 0.0
    # per source token over blocks and heads, plus the rest (MLPs, biases, residual): adds up to Δp
    totals = result.by_source()
    assert totals.shape == (T, S + 1)
    torch.testing.assert_close(totals.sum(-1), result.delta_p, atol=1e-9, rtol=0)
    rest = result.mlp.sum(-1) + result.heads[..., -1].sum(-1) + (result.attn - result.heads.sum(-1)).sum(-1)
    torch.testing.assert_close(totals[:, -1], rest, atol=1e-9, rtol=0)
    # resolution="source" gives the same heads and sources, and no neurons
    only = ig.components(model, trace, resolution="source", steps=16)
    assert only.neurons is None
    torch.testing.assert_close(only.sources, result.sources, atol=0, rtol=0)


def reference_sources(arch, model, trace, m):
    """(T, n, H, S) sum_k w_k <D W_O[:, h] A_h(t, s) v_h(s), grad f(point_k)>, every piece computed
    here: patterns from eager attention with output_attentions=True, values from a hook on the value
    projection, W_O's column slice, Gemma's post-norm by its formula, grad f by torch.autograd of the
    model's own final norm and head, Gauss-Legendre nodes from numpy."""
    attn_name, value_name, cut, out_name = LAYOUT[arch]
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    values, outputs, hooks = {}, {}, []
    for layer, block in enumerate(blocks(eager)):
        hooks.append(block.get_submodule(value_name).register_forward_hook(
            lambda mod, args, out, layer=layer: values.__setitem__(layer, cut(out[0].detach()))))
        hooks.append(block.get_submodule(out_name).register_forward_hook(
            lambda mod, args, out, layer=layer: outputs.__setitem__(layer, out[0].detach())))
    try:
        patterns = eager(trace.input_ids, output_attentions=True, use_cache=False).attentions
    finally:
        for hook in hooks:
            hook.remove()
    base = eager.base_model
    norm = getattr(base, "norm", None) or base.ln_f
    cap = getattr(eager.config, "final_logit_softcapping", None)
    nodes, weights = np.polynomial.legendre.leggauss(m)
    alphas, weights = (nodes + 1) / 2, weights / 2
    T, n, S = len(trace.targets), trace.n_layers, trace.input_ids.shape[1]
    expected = torch.zeros(T, n, HEADS, S, dtype=torch.float64)
    for layer, block in enumerate(blocks(eager)):
        proj = block.get_submodule(out_name)
        weight = proj.weight.detach() if isinstance(proj, torch.nn.Linear) else proj.weight.detach().T  # (d, H hd)
        hd = weight.shape[1] // HEADS
        factor = torch.ones(T, weight.shape[0], dtype=torch.float64)
        if arch == "gemma3":  # the post-attention norm (1 + w) u / rms(u) at the whole output u
            u = outputs[layer][trace.positions]
            post = block.post_attention_layernorm
            factor = (1 + post.weight.detach()) / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + post.eps)
        grad_sum = torch.zeros(T, weight.shape[0], dtype=torch.float64)
        start, end = trace.hidden[layer], trace.mid[layer]
        with torch.enable_grad():
            for alpha, w in zip(alphas, weights):
                point = (start + alpha * (end - start)).requires_grad_(True)
                logits = eager.lm_head(norm(point))
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                f = torch.softmax(logits, -1).gather(-1, trace.targets[:, None]).sum()
                grad_sum += w * torch.autograd.grad(f, point)[0]
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS[arch])
            columns = weight[:, h * hd:(h + 1) * hd]  # (d, hd)
            moved = values[layer][:, kv] @ columns.T  # (S, d): W_O[:, h] v_h(s)
            pattern = patterns[layer][0, h][trace.positions]  # (T, S)
            expected[:, layer, h] = pattern * ((factor * grad_sum) @ moved.T)
    return expected


def test_each_source_share_matches_an_independent_computation(case):
    arch, model, trace = case
    m = 8
    result = ig.components(model, trace, resolution="source", steps=m)
    expected = reference_sources(arch, model, trace, m)
    assert float(expected.abs().max()) > 1e-4
    # float64 models, but the RMSNorms of transformers compute in float32
    tol = 1e-12 if arch == "gpt2" else 1e-7
    torch.testing.assert_close(result.sources, expected, atol=tol, rtol=0)


def test_memory_budget_chunks_give_the_same_sources(case):
    arch, model, trace = case
    small = ig.Readout(model, memory_budget=1)  # one token per source chunk (and per grid chunk)
    # steps=2: the most a 1-byte budget admits (components bounds the grid as ig_lens does)
    torch.testing.assert_close(ig.components(model, trace, resolution="source", steps=2, readout=small).sources,
                               ig.components(model, trace, resolution="source", steps=2).sources,
                               atol=1e-12, rtol=0)


def test_collect_sources_records_the_model_and_restores_attention():
    model = sharp_model("qwen2", scale=4.0)
    before = model.config._attn_implementation
    trace = trace_of(model)
    assert model.config._attn_implementation == before
    plain = ig.collect_components(model, trace.input_ids, trace.prompt_len)
    torch.testing.assert_close(trace.hidden, plain.hidden, atol=1e-5, rtol=1e-5)  # eager vs sdpa
    n, T, S = trace.n_layers, len(trace.targets), trace.input_ids.shape[1]
    assert trace.patterns.shape == (n, T, HEADS, S) and trace.values.shape == (n, S, 2, 8)
    torch.testing.assert_close(trace.patterns.sum(-1), torch.ones(n, T, HEADS), atol=1e-6, rtol=0)
    assert plain.patterns is None and plain.values is None


def test_bad_input():
    model = sharp_model("llama", scale=4.0)
    plain = ig.collect_components(model, torch.arange(10)[None], 4)
    for resolution in ("source", "all"):
        with pytest.raises(ValueError, match="sources=True"):
            ig.components(model, plain, resolution=resolution)
    with pytest.raises(ValueError, match="resolution must be one of"):
        ig.components(model, plain, resolution="sources")
    with pytest.raises(ValueError, match="no sources"):
        ig.components(model, plain, resolution="head").by_source()
    # an attention that changes its output after the pattern-weighted sum of values (here: twice
    # the o_proj input) is caught: the patterns and values no longer rebuild the heads' outputs
    hook = blocks(model)[1].self_attn.o_proj.register_forward_pre_hook(lambda mod, args: (2 * args[0],))
    try:
        with pytest.raises(ValueError, match="block 2: the heads' outputs rebuilt"):
            ig.collect_components(model, torch.arange(10)[None], 4, sources=True)
    finally:
        hook.remove()
