"""Dual Path Attribution itself (issue 34): ``dpa_attribution`` against autograd through the model with
DPA's quantities detached by hooks, against a float64 port of the original's Llama backend, its
completeness on the content path, its place among ``dpa_scores``' methods, and bad input."""
import copy
from contextlib import contextmanager

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import iglens_core as ig
import iglens_dpa as igdpa
import iglens_dpa_method as igdm
from conftest import blocks, tiny_model

ARCHS = ["llama", "qwen2", "gemma3"]  # GQA everywhere; Qwen2: q, k, v biases; Gemma 3: GeGLU, q/k norms, post-norms
LENGTH = 9
RANDOM_WEIGHTS = {"q": 0.7, "k": -0.4, "v": 1.3, "gate": 0.2, "up": 0.9}


def model_of(arch, seed=0, scale=3.0):
    """A float64 tiny model (randomised norm weights) with its matrices scaled up (patterns far from
    uniform) and random projection biases where it has them."""
    model = tiny_model(arch, seed=seed + ARCHS.index(arch), dtype=torch.float64)
    gen = torch.Generator().manual_seed(50 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(scale)
            elif name.endswith("bias") and "norm" not in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def ids_of(seed=1):
    return torch.randint(0, 97, (1, LENGTH), generator=torch.Generator().manual_seed(seed))


@contextmanager
def float64_eager(model, current, edge_gates):
    """Eager attention whose softmax stays in float64 and whose output is multiplied by
    ``edge_gates[block]`` (block from ``current[0]``)."""
    model.set_attn_implementation("eager")
    softmax = torch.nn.functional.softmax

    def patched(x, dim=None, _stacklevel=3, dtype=None):
        out = softmax(x, dim=dim)  # no float32 detour for a float64 model
        return out * edge_gates[current[0]] if edge_gates is not None else out

    torch.nn.functional.softmax = patched
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax


def pre_mlp_norm(block):
    return getattr(block, "pre_feedforward_layernorm", None) or block.post_attention_layernorm


def dpa_by_autograd(model, ids, target, weights, start=None):
    """DPA's quantities by autograd through a copy of the model whose backward is DPA's and whose forward
    is unchanged: every RMSNorm's denominator detached (final, input, pre-MLP, post- and query/key norms);
    the gradients leaving q_proj, k_proj, v_proj scaled by w_q, w_k, w_v (the softmax's own backward left
    as autograd computes it); those leaving gate_proj, up_proj by w_gate, w_up; act_fn's derivative
    replaced by ``act(g) / g``. Unit gates on the post-softmax weights and on act_fn's output give the
    edge and neuron scores (``d logit / d gate = activation x gradient``).

    ``start`` (V,): differentiate ``<start, head output>`` (held fixed) instead of the target's logit.

    Returns: logit (pre-cap, at the last position), carried (n+1, S) ``<h_L, d logit / d h_L>``, edges
    (n, H, S, S), neurons at "post" (n, S, d_ff) and at "mid" (the neuron gates' gradient of
    ``<d logit / d mid_L, MLP increment of block L>``)."""
    model = copy.deepcopy(model)
    n, S = len(blocks(model)), ids.shape[1]
    H, d_ff = model.config.num_attention_heads, model.config.intermediate_size
    edge_gates = [torch.ones(1, H, S, S, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    neuron_gates = [torch.ones(1, S, d_ff, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    states, mids, current, store = {}, {}, [0], {}

    def keep(where, key, tensor):
        tensor.retain_grad()
        where[key] = tensor

    def scaled(w):
        return lambda module, args, out: out.detach() + w * (out - out.detach())

    def fixed_gain(module, args, out):
        g = args[0]
        return out.detach() + (out / g).detach() * (g - g.detach())

    def rms_forward(norm, offset):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        gain = norm.weight + 1.0 if offset else norm.weight
        return lambda x: gain * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach()

    for module in model.modules():
        if "rmsnorm" in type(module).__name__.lower():
            module.forward = rms_forward(module, offset="gemma" in type(module).__name__.lower())
    for layer, block in enumerate(blocks(model)):
        attention, mlp = block.self_attn, block.mlp
        for proj, key in ((attention.q_proj, "q"), (attention.k_proj, "k"), (attention.v_proj, "v"),
                          (mlp.gate_proj, "gate"), (mlp.up_proj, "up")):
            proj.register_forward_hook(scaled(weights[key]))
        mlp.act_fn.register_forward_hook(fixed_gain)
        mlp.act_fn.register_forward_hook(lambda m, args, out, layer=layer: out * neuron_gates[layer])
        attention.register_forward_pre_hook(lambda m, args, layer=layer: current.__setitem__(0, layer))
        block.register_forward_pre_hook(
            lambda m, args, kwargs, layer=layer: keep(states, layer, ig.hidden_arg(args, kwargs)), with_kwargs=True)
        pre_mlp_norm(block).register_forward_pre_hook(lambda m, args, layer=layer: keep(mids, layer, args[0]))
    blocks(model)[-1].register_forward_hook(lambda m, args, out: keep(states, n, ig.first_output(out)))
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: store.__setitem__("logits", out))
    with torch.enable_grad(), float64_eager(model, current, edge_gates):
        model(input_ids=ids, use_cache=False)
        logit = store["logits"][0, -1, target] if start is None else (start * store["logits"][0, -1]).sum()
        logit.backward(retain_graph=True)
        carried = torch.stack([(states[l][0] * states[l].grad[0]).sum(-1) for l in range(n + 1)]).detach()
        c_mid = [mids[layer].grad.clone() for layer in range(n)]  # before the next passes add to .grad
        neurons_mid = []
        for layer in range(n):
            increment = states[layer + 1] - mids[layer]
            (grad,) = torch.autograd.grad((c_mid[layer] * increment).sum(), neuron_gates[layer], retain_graph=True)
            neurons_mid.append(grad[0])
    return dict(logit=float(logit.detach()), carried=carried, edges=torch.cat([g.grad for g in edge_gates]),
                neurons_post=torch.cat([g.grad for g in neuron_gates]), neurons_mid=torch.stack(neurons_mid))


def close(actual, expected, rel=1e-8):
    scale = float(expected.abs().max())
    assert scale > 1e-6  # something to compare
    gap = float((actual - expected).abs().max())
    assert gap <= rel * scale, f"gap {gap:.2e} against scale {scale:.2e}"


@pytest.mark.parametrize("weights", [None, RANDOM_WEIGHTS], ids=["original", "random"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_autograd_through_the_detached_model(arch, weights):
    """Edges, neurons (both cotangents), the credit carried at every residual node and the target logit
    equal autograd's through the model with DPA's quantities detached, float64, within 1e-8 of their scale."""
    model, ids = model_of(arch), ids_of()
    target = int(torch.randint(0, 97, (1,), generator=torch.Generator().manual_seed(ARCHS.index(arch))))
    mid = igdm.dpa_attribution(model, ids, target, weights=weights)
    post = igdm.dpa_attribution(model, ids, target, weights=weights, neurons_at="post")
    ref = dpa_by_autograd(model, ids, target, weights or igdm.DPA_WEIGHTS)
    assert mid["logit"] == pytest.approx(ref["logit"], abs=1e-10 * max(1.0, abs(ref["logit"])))
    close(mid["edges"], ref["edges"])
    close(mid["carried"], ref["carried"])
    close(mid["neurons"], ref["neurons_mid"])
    close(post["neurons"], ref["neurons_post"])
    assert torch.equal(post["edges"], mid["edges"]) and torch.equal(mid["embeddings"], mid["carried"][0])
    future = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)  # key after query
    assert mid["edges"][..., future].abs().max() == 0
    # the two cotangents are not the same scores (the original reads the neurons against mid_L)
    assert (mid["neurons"] - post["neurons"]).abs().max() > 1e-6 * post["neurons"].abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_logprob_start_matches_autograd(arch):
    """``quantity="logprob"``: the start vector is ``g = d log p(target) / d u`` at the recorded head output
    ``u`` (autograd through the model's own soft-cap and log-softmax here), and everything below it equals
    autograd's through the detached model from ``<g, u>``."""
    model, ids = model_of(arch, seed=2), ids_of(3)
    ig.get_adapter(model)  # float64 norms and rotary tables for a float64 model
    with torch.no_grad(), float64_eager(model, [0], None):
        u = model.get_output_embeddings()(model(ids, output_hidden_states=True).hidden_states[-1][0, -1])
    target = int(u.argsort()[len(u) // 2])  # a middling token: p far from 0 and 1
    cap = getattr(model.config, "final_logit_softcapping", None)
    with torch.enable_grad():
        u = u.clone().requires_grad_(True)
        z = torch.tanh(u / cap) * cap if cap else u
        (start,) = torch.autograd.grad(torch.log_softmax(z, -1)[target], u)
    out = igdm.dpa_attribution(model, ids, target, weights=RANDOM_WEIGHTS, quantity="logprob")
    ref = dpa_by_autograd(model, ids, target, RANDOM_WEIGHTS, start=start)
    assert out["logit"] == pytest.approx(ref["logit"], abs=1e-10 * max(1.0, abs(ref["logit"])))
    close(out["edges"], ref["edges"])
    close(out["carried"], ref["carried"])
    close(out["neurons"], ref["neurons_mid"])
    logit = igdm.dpa_attribution(model, ids, target, weights=RANDOM_WEIGHTS)
    assert (out["edges"] - logit["edges"]).abs().max() > 1e-3 * logit["edges"].abs().max()  # another start


def original_llama_backend(model, ids, target):
    """A float64 port of the original's ``Llama2Backend`` (tracer/backend.py: run_forward_and_cache,
    get_mlp_update, get_attn_update, get_component_contributions, the q=k=0.25, v=gate=up=0.5 default),
    ``BaseTracer._init_gradients`` and ``ComponentTracer.batch_trace`` (tracer/tracer.py), batch of one,
    its activations cached by hooks. Its RMS scales use eps 1e-7, as the original's get_rmsnorm_scaling.
    Returns edges (n, H, S, S) and neurons (n, S, d_ff), both read against ``residual_targets["mid.L"]``."""
    config = model.config
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    hd, groups = config.hidden_size // nh, nh // nkv
    w = {"up": 0.5, "gate": 0.5, "v": 0.5, "q": 0.25, "k": 0.25}
    cache, hooks, layers = {}, [], blocks(model)

    def rms_scale(x):
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-7)

    def put(key, value):
        cache[key] = value.detach()

    for i, layer in enumerate(layers):
        att, mlp = layer.self_attn, layer.mlp
        hooks += [layer.register_forward_pre_hook(
                      lambda m, a, kw, i=i: put(f"ln.attn.{i}", rms_scale(ig.hidden_arg(a, kw))), with_kwargs=True),
                  att.register_forward_pre_hook(lambda m, a, kw: cache.__setitem__("rotary", kw["position_embeddings"]),
                                                with_kwargs=True),
                  att.q_proj.register_forward_hook(lambda m, a, o, i=i: put(f"q.{i}", o)),
                  att.k_proj.register_forward_hook(lambda m, a, o, i=i: put(f"k.{i}", o)),
                  att.v_proj.register_forward_hook(lambda m, a, o, i=i: put(f"v.{i}", o)),
                  att.register_forward_hook(lambda m, a, o, i=i: put(f"attn.{i}.weights", o[1])),
                  att.o_proj.register_forward_pre_hook(lambda m, a, i=i: put(f"z.{i}", a[0])),
                  layer.post_attention_layernorm.register_forward_pre_hook(
                      lambda m, a, i=i: put(f"ln.mlp.{i}", rms_scale(a[0]))),
                  mlp.gate_proj.register_forward_hook(lambda m, a, o, i=i: put(f"mlp.{i}.gate_proj", o)),
                  mlp.act_fn.register_forward_hook(lambda m, a, o, i=i: put(f"mlp.{i}.gate_act", o)),
                  mlp.up_proj.register_forward_hook(lambda m, a, o, i=i: put(f"mlp.{i}.up_proj", o)),
                  mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: put(f"mlp.{i}.act_prod", a[0]))]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: put("final_ln", rms_scale(a[0][:, -1]))))
    with torch.no_grad(), float64_eager(model, [0], None):
        model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    B, S = ids.shape
    cos, sin = cache["rotary"]
    for i in range(len(layers)):
        q = cache[f"q.{i}"].view(B, S, nh, hd).transpose(1, 2)
        k = cache[f"k.{i}"].view(B, S, nkv, hd).transpose(1, 2)
        rot_q, rot_k = apply_rotary_pos_emb(q, k, cos, sin)
        cache[f"attn.{i}.rot_q"], cache[f"attn.{i}.rot_k"] = rot_q, rot_k.repeat_interleave(groups, dim=1)
        cache[f"attn.{i}.v"] = cache[f"v.{i}"].view(B, S, nkv, hd).transpose(1, 2).repeat_interleave(groups, dim=1)
        cache[f"attn.{i}.z"] = cache[f"z.{i}"].view(B, S, nh, hd).transpose(1, 2)

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

    grad = torch.zeros(B, S, config.hidden_size, dtype=torch.float64)  # _init_gradients
    grad[:, -1] = model.lm_head.weight[target] * model.model.norm.weight * cache["final_ln"]
    mids = {}
    for i in reversed(range(len(layers))):  # batch_trace
        layer = layers[i]
        # get_mlp_update
        ln = cache[f"ln.mlp.{i}"]
        grad_mid = grad @ layer.mlp.down_proj.weight
        norm_w = layer.post_attention_layernorm.weight
        up_term = (grad_mid * cache[f"mlp.{i}.gate_act"] * ln) @ (layer.mlp.up_proj.weight * norm_w)
        gate_term = ((grad_mid * cache[f"mlp.{i}.gate_proj"].sigmoid() * cache[f"mlp.{i}.up_proj"] * ln)
                     @ (layer.mlp.gate_proj.weight * norm_w))
        grad = grad + w["up"] * up_term + w["gate"] * gate_term
        mids[i] = grad.clone()
        # get_attn_update
        att, norm_w, ln = layer.self_attn, layer.input_layernorm.weight, cache[f"ln.attn.{i}"]
        q_w = att.q_proj.weight.view(nh, hd, -1)
        k_w = att.k_proj.weight.view(nkv, hd, -1).repeat_interleave(groups, 0)
        v_w = att.v_proj.weight.view(nkv, hd, -1).repeat_interleave(groups, 0)
        A, v, z = cache[f"attn.{i}.weights"], cache[f"attn.{i}.v"], cache[f"attn.{i}.z"]
        gm = (grad @ att.o_proj.weight).view(B, S, nh, hd).transpose(1, 2)  # (B, H, Q, D)
        v_scalar = (A * ln.transpose(-1, -2).unsqueeze(1)).transpose(-2, -1)
        v_term = (v_scalar @ gm).transpose(1, 2).flatten(-2) @ (v_w * norm_w).flatten(0, 1)
        delta = A * (gm @ v.transpose(-1, -2) - (gm * z).sum(-1, keepdim=True))
        wk = (delta @ cache[f"attn.{i}.rot_k"]) * hd ** -0.5
        grad_q = wk * cos[:, None] - rotate_half(wk) * sin[:, None]
        q_term = (grad_q.transpose(1, 2).flatten(-2) @ (q_w * norm_w).flatten(0, 1)) * ln
        wq = (delta.transpose(-2, -1) @ cache[f"attn.{i}.rot_q"]) * hd ** -0.5
        grad_k = wq * cos[:, None] - rotate_half(wq) * sin[:, None]
        k_term = (grad_k.transpose(1, 2).flatten(-2) @ (k_w * norm_w).flatten(0, 1)) * ln
        grad = grad + w["v"] * v_term + w["q"] * q_term + w["k"] * k_term
    edges, neurons = [], []
    for i, layer in enumerate(layers):  # get_component_contributions
        v = cache[f"v.{i}"].view(B, S, nkv, hd).repeat_interleave(groups, -2)  # (B, K, H, D)
        o = layer.self_attn.o_proj.weight.T.view(nh, hd, -1)
        d_attn = torch.einsum("bhqkd,hdm->bqkhm", torch.einsum("bkhd,bhqk->bhqkd", v, cache[f"attn.{i}.weights"]), o)
        edges.append(torch.einsum("bqd,bqkhd->bqkh", mids[i], d_attn)[0].permute(2, 0, 1))  # (H, Q, K)
        d_mlp = torch.einsum("bth,hm->bthm", cache[f"mlp.{i}.act_prod"], layer.mlp.down_proj.weight.T)
        neurons.append(torch.einsum("bqd,bqhd->bqh", mids[i], d_mlp)[0])
    return torch.stack(edges).detach(), torch.stack(neurons).detach()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_equals_a_port_of_the_original_backend(arch):
    """With the original's RMS epsilon (1e-7) on the model, the default weights and ``neurons_at="mid"``
    reproduce a float64 line-for-line port of the original's Llama2Backend (Qwen2Backend is the same),
    sigmoid gate gain and its rotary transpose included."""
    model = model_of(arch, seed=2)
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 1e-7
    ids, target = ids_of(4), 11
    ig.get_adapter(model)  # float64 norms and rotary tables for a float64 model, in the port's pass too
    edges, neurons = original_llama_backend(model, ids, target)
    out = igdm.dpa_attribution(model, ids, target)
    close(out["edges"], edges)
    close(out["neurons"], neurons)


@pytest.mark.parametrize("arch", ARCHS)
def test_completeness_on_the_content_path(arch):
    """v = 1, q = k = 0, gate + up = 1: every residual node carries the target logit (the model's own,
    before any soft-cap) less the biases' credit above it, the embeddings included; the original's
    default weights miss it (their query and key terms are not the attention's output)."""
    model, ids = model_of(arch, seed=1), ids_of(2)
    ig.get_adapter(model)  # float64 norms and rotary tables for a float64 model
    logits = {}
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: logits.__setitem__("x", out))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    hook.remove()
    target = int(logits["x"][0, -1].argmin())
    expected = float(logits["x"][0, -1, target])
    gate = float(torch.rand(1, generator=torch.Generator().manual_seed(7)))
    content = {"q": 0.0, "k": 0.0, "v": 1.0, "gate": gate, "up": 1 - gate}
    out = igdm.dpa_attribution(model, ids, target, weights=content, neurons_at="post")
    assert out["logit"] == pytest.approx(expected, abs=1e-10 * max(1.0, abs(expected)))
    above = out["constants"].flip(0).cumsum(0).flip(0)  # (n+1,) constants of blocks >= L and the head
    gaps = out["carried"].sum(1) + above - expected
    assert gaps.abs().max() < 1e-10 * max(1.0, abs(expected)), gaps
    assert abs(float(out["embeddings"].sum() + out["constants"].sum()) - expected) < 1e-10 * max(1.0, abs(expected))
    for weights in (None, {"q": 0.0, "k": 0.0, "v": 1.0, "gate": 0.6, "up": 0.6}):
        other = igdm.dpa_attribution(model, ids, target, weights=weights)
        assert abs(float(other["embeddings"].sum() + other["constants"].sum()) - expected) > 1e-6


def test_registered_among_the_methods():
    """``dpa_scores(..., "dpa")`` is dpa_attribution's edges and neurons with the original's defaults,
    in the layout ``dpa_ablation`` takes."""
    model, ids = model_of("llama", seed=3), ids_of(5)
    assert "dpa" in igdpa.DPA_METHODS
    with torch.no_grad():
        target = int(model(ids).logits[0, -1].argmax())
    scores = igdpa.dpa_scores(model, ids, target, "dpa")
    full = igdm.dpa_attribution(model, ids, target)
    assert set(scores) == {"edges", "neurons"}
    assert torch.equal(scores["edges"], full["edges"]) and torch.equal(scores["neurons"], full["neurons"])
    drops = igdpa.dpa_ablation(model, ids, target, scores, fractions=[0.01, 0.5])
    assert drops.shape == (2,) and abs(drops).max() > 0


def test_bad_input():
    model, ids = model_of("llama"), ids_of()
    for weights, word in (({"q": 1.0}, "keys"), ({**igdm.DPA_WEIGHTS, "v": float("nan")}, "weights['v']"),
                          ({**igdm.DPA_WEIGHTS, "up": True}, "weights['up']"), ("0.5", "keys")):
        with pytest.raises(ValueError, match=word.replace("[", r"\[")):
            igdm.dpa_attribution(model, ids, 3, weights=weights)
    with pytest.raises(ValueError, match="neurons_at"):
        igdm.dpa_attribution(model, ids, 3, neurons_at="pre")
    with pytest.raises(ValueError, match="quantity must be one of .'logit', 'logprob'., got 'prob'"):
        igdm.dpa_attribution(model, ids, 3, quantity="prob")
    with pytest.raises(ValueError, match="0..96"):
        igdm.dpa_attribution(model, ids, 97)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*gated MLPs"):
        igdm.dpa_attribution(tiny_model("gpt2", dtype=torch.float64), ids, 3)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.*soft-capping"):
        igdm.dpa_attribution(tiny_model("gemma2", dtype=torch.float64), ids, 3)
    model.train()
    with pytest.raises(ValueError, match="eval"):
        igdm.dpa_attribution(model, ids, 3)
