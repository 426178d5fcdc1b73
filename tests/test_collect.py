"""The collector records the input of the final norm and the block outputs."""
import torch

import iglens_core as ig
from conftest import random_trace, tiny_model


def test_last_node_is_not_hf_normalised_hidden_state():
    model = tiny_model("llama")
    trace = random_trace(model)
    with torch.no_grad():
        out = model(trace.input_ids, output_hidden_states=True)
    hf_last = out.hidden_states[-1][0, trace.positions]
    normed_input = model.model.norm(trace.hidden[-1])
    torch.testing.assert_close(hf_last, normed_input, atol=1e-5, rtol=1e-5)
    assert (hf_last - trace.hidden[-1]).abs().max() > 1e-2


def _skip_blocks_from(model, layer):
    """Forward hooks making blocks layer+1..n identities."""
    blocks = ig.get_adapter(model).blocks
    return [block.register_forward_hook(
        lambda mod, args, kwargs, out: (ig.hidden_arg(args, kwargs),) + tuple(out[1:])
        if isinstance(out, tuple) else ig.hidden_arg(args, kwargs), with_kwargs=True)
        for block in blocks[layer:]]


def test_lens_node_equals_model_with_later_blocks_skipped(arch_model):
    trace = random_trace(arch_model)
    lens = ig.logit_lens(arch_model, trace)  # (T, n+1)
    for layer in range(1, trace.n_layers):
        hooks = _skip_blocks_from(arch_model, layer)
        try:
            with torch.no_grad():
                logits = arch_model(trace.input_ids).logits[0, trace.positions]
        finally:
            for hook in hooks:
                hook.remove()
        expected = torch.softmax(logits, -1)[torch.arange(len(trace.targets)), trace.targets]
        torch.testing.assert_close(lens[:, layer], expected, atol=1e-6, rtol=1e-5)


def test_targets_and_positions():
    model = tiny_model("gpt2")
    trace = random_trace(model, length=10, prompt_len=4)
    assert trace.targets.tolist() == trace.input_ids[0, 4:].tolist()
    assert trace.positions.tolist() == list(range(3, 9))
    assert trace.hidden.shape == (4, 6, 32)


def test_float64_model_keeps_float64():
    model = tiny_model("llama", dtype=torch.float64)
    trace = random_trace(model)
    assert trace.hidden.dtype == torch.float64
    attribution = ig.ig_lens(model, trace, steps=4, profile=True)
    assert attribution.values.dtype == torch.float64
    assert attribution.residual < 1e-13


def test_mid_points_are_residual_between_attention_and_mlp():
    model = tiny_model("llama")
    trace = random_trace(model, sublayer=True)
    attn_out = {}
    hooks = [block.self_attn.register_forward_hook(
        lambda mod, args, out, i=i: attn_out.__setitem__(i, out[0][0, trace.positions]))
        for i, block in enumerate(model.model.layers)]
    with torch.no_grad():
        model(trace.input_ids)
    for hook in hooks:
        hook.remove()
    for i in range(trace.n_layers):
        torch.testing.assert_close(trace.mid[i], trace.hidden[i] + attn_out[i], atol=1e-6, rtol=1e-5)
