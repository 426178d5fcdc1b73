"""A float64 model computes in float64 end to end (float64_forward), not in float32 in places."""

import numpy as np
import pytest
import torch

import iglens_baselines as igb
import iglens_core as ig
from conftest import random_trace, tiny_model


def _dla_gap(model, trace):
    """max |block DLAs + rest - the model's own target logit| over the trace's tokens."""
    values, rest = igb.direct_logit_attribution(model, trace, return_rest=True)
    with torch.no_grad():
        logits = model(trace.input_ids, use_cache=False).logits[0, trace.positions].double()
    own = logits.gather(-1, trace.targets[:, None])[:, 0]
    total = values.sum(-1) + rest                        # the pre-soft-cap logit
    cap = getattr(model.config, "final_logit_softcapping", None)
    total = cap * torch.tanh(total / cap) if cap else total
    return float((total - own).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3"])
def test_float64_model_adds_up_to_its_logit_within_1e12(arch):
    model = tiny_model(arch, seed=3, dtype=torch.float64)
    assert ig.float64_forward(model) == []                # nothing left in float32
    trace = random_trace(model, seed=4)
    assert _dla_gap(model, trace) < 1e-12
    # without the patch the same check misses by float32 rounding: the test can fail
    plain = tiny_model(arch, seed=3, dtype=torch.float64)
    plain.__dict__["_iglens_float32_parts"] = []         # marks it as done: left unpatched
    assert _dla_gap(plain, random_trace(plain, seed=4)) > 1e-10


def _rms_norm64(norm, hidden):
    """Float64 RMSNorm written out: w * h / sqrt(mean(h^2) + eps)."""
    h = hidden.double().numpy()
    w = norm.weight.detach().double().numpy()
    return w * h / np.sqrt((h ** 2).mean(-1, keepdims=True) + norm.variance_epsilon)


def test_olmo_weightless_layer_norm_in_float64():
    model = tiny_model("olmo", seed=2, dtype=torch.float64)
    trace = random_trace(model, seed=1)
    h = trace.hidden[-1].double()
    normed = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5)
    want = torch.softmax(normed @ model.lm_head.weight.detach().T, -1).gather(-1, trace.targets[:, None])[:, 0]
    torch.testing.assert_close(trace.model_probs, want, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(ig.Readout(model)(trace.hidden[-1], trace.targets), want, atol=1e-14, rtol=1e-12)


def test_readout_of_the_final_state_matches_a_float64_norm():
    model = tiny_model("llama", seed=5, dtype=torch.float64)
    trace = random_trace(model, seed=6)
    readout = ig.Readout(model)
    logits = _rms_norm64(readout.adapter.norm, trace.hidden[-1]) @ model.lm_head.weight.detach().double().numpy().T
    want = torch.softmax(torch.from_numpy(logits), -1).gather(-1, trace.targets[:, None])[:, 0]
    got = readout(trace.hidden[-1], trace.targets)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(ig.ig_lens(model, trace).p_final, trace.model_probs, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "neox"])
def test_rotary_cos_sin_in_float64(arch):
    model = tiny_model(arch, seed=1, dtype=torch.float64)
    ig.float64_forward(model)
    rotary = model.base_model.rotary_emb
    positions = torch.arange(40)[None]
    x = torch.zeros(1, dtype=torch.float64)
    layer_type = ["sliding_attention"] if arch == "gemma3" else []
    cos, sin = rotary(x, positions, *layer_type)
    prefix = f"{layer_type[0]}_" if layer_type else ""
    inv_freq = getattr(rotary, prefix + "inv_freq").numpy()
    angles = np.arange(40)[:, None] * inv_freq[None]                           # numpy float64
    scaling = getattr(rotary, prefix + "attention_scaling")
    assert cos.dtype == torch.float64
    np.testing.assert_allclose(cos[0].numpy(), np.cos(np.concatenate([angles, angles], -1)) * scaling, rtol=0, atol=1e-15)
    np.testing.assert_allclose(sin[0].numpy(), np.sin(np.concatenate([angles, angles], -1)) * scaling, rtol=0, atol=1e-15)
    # float32 inputs still take the model's own float32 path
    cos32, _ = rotary(x.float(), positions, *layer_type)
    assert cos32.dtype == torch.float32
    assert float((cos32.double() - cos).abs().max()) < 1e-5


def test_float32_model_is_left_alone_and_a_dynamic_rope_is_reported():
    model = tiny_model("llama", seed=0)
    assert ig.float64_forward(model) == [] and "forward" not in model.model.norm.__dict__
    import transformers
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    dynamic = transformers.LlamaForCausalLM(config).double().eval()
    with pytest.warns(UserWarning, match="still compute in float32.*rotary_emb"):
        assert ig.float64_forward(dynamic) == ["model.rotary_emb"]
