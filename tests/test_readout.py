"""The head-once readout reproduces the model's own probabilities, chunking changes nothing."""
import torch

import iglens_core as ig
import iglens_data as igd
from conftest import random_trace, tiny_model


def test_final_node_is_model_probability(arch_model):
    trace = random_trace(arch_model)
    probs = ig.Readout(arch_model)(trace.hidden[-1], trace.targets)
    torch.testing.assert_close(probs, trace.model_probs, atol=1e-6, rtol=1e-5)


def test_model_probs_match_logits_computed_independently(arch_model):
    trace = random_trace(arch_model)
    with torch.no_grad():
        logits = arch_model(trace.input_ids).logits[0]
    expected = torch.softmax(logits, -1)[trace.positions, trace.targets]
    torch.testing.assert_close(trace.model_probs, expected, atol=1e-6, rtol=1e-5)


def test_softcap_is_applied():
    model = tiny_model("gemma3")
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # logits large enough for the cap to bite
    trace = random_trace(model)
    readout = ig.Readout(model)
    torch.testing.assert_close(readout(trace.hidden[-1], trace.targets), trace.model_probs,
                               atol=1e-6, rtol=1e-5)
    assert readout.adapter.softcap == 3.0
    readout.adapter.softcap = None  # without it the probabilities must differ
    assert (readout(trace.hidden[-1], trace.targets) - trace.model_probs).abs().max() > 1e-3


def test_chunk_size_does_not_change_results():
    model = tiny_model("llama")
    trace = random_trace(model)
    big = ig.Readout(model)(trace.hidden, trace.targets[None])
    tiny = ig.Readout(model, memory_budget=1)  # one row per chunk
    assert tiny.chunk_rows() == 1
    torch.testing.assert_close(tiny(trace.hidden, trace.targets[None]), big, atol=1e-7, rtol=0)


def test_directional_derivative_matches_autograd(arch_model):
    trace = random_trace(arch_model)
    readout = ig.Readout(arch_model)
    gen = torch.Generator().manual_seed(1)
    points = trace.hidden[1] + torch.randn(trace.hidden[1].shape, generator=gen)
    direction = torch.randn(points.shape, generator=gen)
    with torch.enable_grad():
        x = points.clone().requires_grad_(True)
        logits = readout.logits(x)
        f = torch.softmax(logits, -1)[torch.arange(len(x)), trace.targets]
        (grad,) = torch.autograd.grad(f.sum(), x)
    expected = (grad * direction).sum(-1)
    got = readout.directional(points, direction, trace.targets)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)


def test_packaged_model_probability(packaged):
    model, tokenizer = packaged
    ids, prompt_len = igd.encode(tokenizer, "What is the capital of Vietnam?",
                                "The capital of Vietnam is Hanoi.")
    trace = ig.collect(model, ids, prompt_len)
    probs = ig.Readout(model)(trace.hidden[-1], trace.targets)
    torch.testing.assert_close(probs, trace.model_probs, atol=5e-5, rtol=0)
